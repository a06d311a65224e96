//! How many expression nodes a statement stands for once PostgreSQL's analysis and planning
//! have copied what they copy (see [`expanded_size`]): the gate refuses a statement past
//! `MAX_EXPANDED_NODES` (in `bounds`).

use super::MAX_DEPTH;

/// The nodes a parse tree (read as JSON) stands for once PostgreSQL's analysis and planning have
/// copied what they copy, saturating:
/// * the left side of each `BETWEEN` (2 copies, 4 for `SYMMETRIC`) and of each `IN` list holding
///   anything but constants (one per item);
/// * a subquery's or common table expression's output expressions, once per reference to them:
///   the planner pulls a simple subquery (and a CTE referenced once) up into the query above,
///   replacing every reference to its columns by the expression itself. A chain of 26 CTEs each
///   selecting `s || s` from the one before (1.3 KB of text) made one server process allocate
///   22 GB while planning, past its statement timeout, until the kernel's OOM killer ended it
///   and the whole server restarted every session. References are resolved against the FROM
///   items in scope (this query's and every enclosing one's) as PostgreSQL resolves them, and
///   where the gate cannot tell, counted as the largest they could be: a column as the largest
///   output of that name (or of any name PostgreSQL names itself), a whole-row reference or a
///   function called on a row (`t`, `row_to_json(t)`, `t.text`) as all of that item's outputs,
///   a join's alias as both sides', a `*` as everything in scope;
/// * the grouping sets `CUBE`, `ROLLUP` and `GROUPING SETS` expand to (their number times their
///   width: PostgreSQL builds and compares every set while analysing, uninterruptibly, 3.3 s
///   past a 1 s timeout for `CUBE` of 12 beside a set of 1,600).
///
/// Depth is bounded by the walk before it.
pub(in crate::sql_gate) fn expanded_size(value: &serde_json::Value, depth: usize) -> u64 {
    size(value, &Scope::default(), Walk::Whole, depth)
}

/// A FROM item in scope: the name a qualified or whole-row reference uses for it, and what its
/// outputs stand for.
#[derive(Clone, Default)]
struct Source {
    alias: Option<String>,
    /// Outputs by name (alias column lists applied).
    columns: Vec<(String, u64)>,
    /// The largest output whose name the gate does not know (PostgreSQL names an expression
    /// itself; a `*` brings names of its own): a reference of any name may be it.
    unnamed: u64,
    /// All outputs together: a whole-row reference.
    all: u64,
}

impl Source {
    /// A reference to its column `name`, if it may have one.
    fn column(&self, name: &str) -> Option<u64> {
        let named = self
            .columns
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, s)| *s)
            .max();
        match named {
            Some(s) => Some(s.max(self.unnamed)),
            None if self.unnamed > 0 => Some(self.unnamed),
            None => None,
        }
    }

    fn widest(&self) -> u64 {
        self.columns
            .iter()
            .fold(self.unnamed, |m, (_, s)| m.max(*s))
    }
}

/// What the references of a query may stand for: the FROM items in scope, and the CTEs a FROM
/// item may name.
#[derive(Clone, Default)]
struct Scope {
    sources: Vec<Source>,
    ctes: Vec<(String, Outputs)>,
}

impl Scope {
    /// What a column reference with these fields stands for (`[relation.]column`, or a row).
    fn column(&self, fields: &[&str]) -> u64 {
        let found = match fields {
            [] => self.star(),
            // A column of any item in scope, or the whole row of an item of that name.
            [name] => self.sources.iter().fold(0, |m, s| {
                let row = if s.alias.as_deref() == Some(*name) {
                    s.all
                } else {
                    0
                };
                m.max(s.column(name).unwrap_or(0)).max(row)
            }),
            [.., qualifier, name] => {
                let named: Vec<&Source> = self
                    .sources
                    .iter()
                    .filter(|s| s.alias.as_deref() == Some(*qualifier))
                    .collect();
                if named.is_empty() {
                    // A base relation's column, or a schema-qualified one: as unqualified.
                    self.sources
                        .iter()
                        .fold(0, |m, s| m.max(s.column(name).unwrap_or(0)))
                } else {
                    // Not a column of it: a function called on its row (`t.text`).
                    named
                        .iter()
                        .fold(0, |m, s| m.max(s.column(name).unwrap_or(s.all)))
                }
            }
        };
        found.max(1)
    }

    /// What a `*` stands for: everything in scope.
    fn star(&self) -> u64 {
        self.sources
            .iter()
            .fold(0u64, |n, s| n.saturating_add(s.all))
            .max(1)
    }
}

/// A query's size and its outputs in order (`None`: a name PostgreSQL gives), with what a `*`
/// among them brought in.
#[derive(Clone, Default)]
struct Outputs {
    total: u64,
    columns: Vec<(Option<String>, u64)>,
    starred: Option<Source>,
}

impl Outputs {
    /// The outputs as a FROM item named `alias`, renamed by an alias column list.
    fn source(&self, alias: Option<String>, renames: &[String]) -> Source {
        let mut source = Source {
            alias,
            ..Source::default()
        };
        let own: u64 = self
            .columns
            .iter()
            .fold(0u64, |n, (_, s)| n.saturating_add(*s));
        if let Some(starred) = &self.starred {
            // Positions are not known: every new name may be any output.
            let any = self
                .columns
                .iter()
                .fold(starred.widest(), |m, (_, s)| m.max(*s));
            if renames.is_empty() {
                source.columns.extend(starred.columns.iter().cloned());
                for (name, size) in &self.columns {
                    match name {
                        Some(n) => source.columns.push((n.clone(), *size)),
                        None => source.unnamed = source.unnamed.max(*size),
                    }
                }
                source.unnamed = source.unnamed.max(starred.unnamed);
            } else {
                source.columns = renames.iter().map(|n| (n.clone(), any)).collect();
                source.unnamed = any;
            }
            source.all = own.saturating_add(starred.all);
            return source;
        }
        for (i, (name, size)) in self.columns.iter().enumerate() {
            match renames.get(i).cloned().or_else(|| name.clone()) {
                Some(n) => source.columns.push((n, *size)),
                None => source.unnamed = source.unnamed.max(*size),
            }
        }
        source.all = own;
        source
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
            if let Some(case) = fields.get("CaseExpr")
                && case.get("arg").is_some_and(|a| !a.is_null())
                && !case
                    .get("arg")
                    .is_some_and(|a| settled_case_value(a, scope, 0))
            {
                return UNBOUNDED;
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

/// What [`expanded_size`] answers for a statement whose copies have no bound it can state.
pub(in crate::sql_gate) const UNBOUNDED: u64 = u64::MAX;

/// Whether the test value of a simple `CASE x WHEN ... END` is one the planner cannot fold
/// into a constant of any size: a literal (bounded by the statement's text) or a column of a
/// table (not a subquery's output, which may be an expression), or a cast of one. A value the
/// planner folds (`repeat(...)`, a parameter, a subquery's computed output) is copied, whole,
/// into every `WHEN` arm while it plans, without checking for cancellation: five arms over a
/// 500 MB `repeat` took 2.4 GB past a 500 ms timeout; a parameter is bounded only by the
/// plugin's memory, the arms by the statement's tokens. Write `CASE WHEN x = ... THEN`.
fn settled_case_value(arg: &serde_json::Value, scope: &Scope, depth: usize) -> bool {
    let Some((kind, value)) = arg
        .get("node")
        .and_then(serde_json::Value::as_object)
        .and_then(|n| n.iter().next())
    else {
        return false;
    };
    match kind.as_str() {
        "AConst" => true,
        "ColumnRef" => column_name(value).is_some() && scope.column(&column_fields(value)) <= 1,
        "TypeCast" if depth < 8 => value
            .get("arg")
            .is_some_and(|a| settled_case_value(a, scope, depth + 1)),
        _ => false,
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

/// A query's size and outputs. Its CTEs come first (each sees the ones before it), then its
/// FROM items in order (a LATERAL one sees the ones before it); the rest of the query sees
/// them all.
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
            let mut outputs = subquery(q, &scope, depth + 1);
            out.total = out.total.saturating_add(outputs.total);
            let renames = names(cte.get("aliascolnames"));
            if !renames.is_empty() {
                let renamed = outputs.source(None, &renames);
                outputs.columns = renamed
                    .columns
                    .into_iter()
                    .map(|(n, s)| (Some(n), s))
                    .collect();
                outputs.columns.push((None, renamed.unnamed));
                outputs.starred = None;
            }
            if let Some(name) = cte.get("ctename").and_then(Value::as_str) {
                scope.ctes.push((name.to_string(), outputs));
            }
        }
    }
    // A set operation: its arms are the queries; the outputs are the first arm's names, each
    // as large as both arms' at that place together (a condition on a `UNION ALL` subquery is
    // pushed into every arm, with that arm's expression in place of each reference: 1,400 arms
    // and 2,400 references planned into 1.9 GB).
    if let (Some(Value::Object(l)), Some(Value::Object(r))) =
        (fields.get("larg"), fields.get("rarg"))
    {
        let (l, r) = (query(l, &scope, depth + 1), query(r, &scope, depth + 1));
        let mut columns = l.columns.clone();
        for (i, (_, s)) in columns.iter_mut().enumerate() {
            *s = (*s).saturating_add(r.columns.get(i).map_or(0, |c| c.1));
        }
        let starred = match (l.starred, r.starred) {
            (None, None) => None,
            (a, b) => {
                let (mut a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
                a.columns.extend(b.columns);
                a.unnamed = a.unnamed.max(b.unnamed);
                a.all = a.all.saturating_add(b.all);
                Some(a)
            }
        };
        return Outputs {
            total: out.total.saturating_add(l.total).saturating_add(r.total),
            columns,
            starred,
        };
    }
    for key in ["from_clause", "using_clause", "source_relation"] {
        if let Some(from) = fields.get(key) {
            from_items(from, &mut scope, &mut out.total, depth + 1);
        }
    }
    for (key, value) in fields {
        let part = match key.as_str() {
            "with_clause" | "larg" | "rarg" => 0,
            "from_clause" | "using_clause" | "source_relation" => {
                size(value, &scope, Walk::SkipSubqueries, depth + 1)
            }
            "group_clause" => size(value, &scope, Walk::Whole, depth + 1)
                .saturating_add(grouping_sets(value, depth + 1)),
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
                                let starred = out.starred.get_or_insert_with(Source::default);
                                for source in &scope.sources {
                                    starred.columns.extend(source.columns.iter().cloned());
                                    starred.unnamed = starred.unnamed.max(source.unnamed);
                                    starred.all = starred.all.saturating_add(source.all);
                                }
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
    out
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

/// A subquery node (`{"SelectStmt": ...}`, or any statement a CTE may hold) sized as a query.
fn subquery(node: &serde_json::Value, scope: &Scope, depth: usize) -> Outputs {
    let inner = node
        .get("node")
        .and_then(serde_json::Value::as_object)
        .and_then(|n| n.values().next())
        .and_then(serde_json::Value::as_object);
    match inner {
        Some(fields) if is_query(fields) => query(fields, scope, depth),
        _ => {
            let total = size(node, scope, Walk::Whole, depth);
            Outputs {
                total,
                columns: vec![(None, total)],
                starred: None,
            }
        }
    }
}

/// Brings the FROM items of `value` into `scope`, in order, through joins; sizes their
/// subqueries into `total`. Returns the item `value` stands for, to a join above it.
fn from_items(
    value: &serde_json::Value,
    scope: &mut Scope,
    total: &mut u64,
    depth: usize,
) -> Option<Source> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        *total = u64::MAX;
        return None;
    }
    let alias_of = |v: &Value| {
        v.pointer("/alias/aliasname")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
    };
    let renames_of = |v: &Value| names(v.pointer("/alias/colnames"));
    match value {
        Value::Array(items) => {
            for item in items {
                from_items(item, scope, total, depth + 1);
            }
            None
        }
        Value::Object(fields) => {
            if let Some(node) = fields.get("node") {
                return from_items(node, scope, total, depth + 1);
            }
            let source = if let Some(sub) = fields.get("RangeSubselect") {
                let outputs = sub
                    .get("subquery")
                    .map(|q| subquery(q, scope, depth + 1))
                    .unwrap_or_default();
                *total = total.saturating_add(outputs.total);
                outputs.source(alias_of(sub), &renames_of(sub))
            } else if let Some(rel) = fields.get("RangeVar") {
                let name = rel.get("relname").and_then(Value::as_str).unwrap_or("");
                let unqualified = rel
                    .get("schemaname")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty);
                let alias = alias_of(rel).or_else(|| Some(name.to_string()));
                let cte = scope
                    .ctes
                    .iter()
                    .rev()
                    .find(|(n, _)| unqualified && n == name)
                    .map(|(_, o)| o.clone());
                match cte {
                    Some(outputs) => outputs.source(alias, &renames_of(rel)),
                    None => Source {
                        alias,
                        columns: renames_of(rel).into_iter().map(|n| (n, 1)).collect(),
                        ..Source::default()
                    },
                }
            } else if let Some(join) = fields.get("JoinExpr") {
                let left = join
                    .get("larg")
                    .and_then(|l| from_items(l, scope, total, depth + 1))
                    .unwrap_or_default();
                let right = join
                    .get("rarg")
                    .and_then(|r| from_items(r, scope, total, depth + 1))
                    .unwrap_or_default();
                // Both sides, under the join's alias when it has one (a reference to the join
                // by that alias, or to a column it renames, stands for either side's).
                let both = Outputs {
                    total: 0,
                    columns: Vec::new(),
                    starred: Some(Source {
                        alias: None,
                        columns: left.columns.iter().chain(&right.columns).cloned().collect(),
                        unnamed: left.unnamed.max(right.unnamed),
                        all: left.all.saturating_add(right.all),
                    }),
                };
                let source = both.source(alias_of(join), &renames_of(join));
                if source.alias.is_none() {
                    // Its sides are in scope already.
                    return Some(source);
                }
                source
            } else {
                // A function, a table sample, XMLTABLE: not pulled up; its columns are its own.
                let item = fields.values().next().unwrap_or(&Value::Null);
                Source {
                    alias: alias_of(item),
                    columns: renames_of(item).into_iter().map(|n| (n, 1)).collect(),
                    ..Source::default()
                }
            };
            scope.sources.push(source.clone());
            Some(source)
        }
        _ => None,
    }
}

/// How many grouping sets a GROUP BY clause expands to, times their width: `CUBE` of n items
/// is 2^n sets, `ROLLUP` n + 1, `GROUPING SETS` the sum of its members', and the items of the
/// clause multiply (PostgreSQL takes every combination).
fn grouping_sets(clause: &serde_json::Value, depth: usize) -> u64 {
    let items = clause.as_array().map_or(&[][..], Vec::as_slice);
    let (sets, width) = items.iter().fold((1u64, 0u64), |(sets, width), item| {
        let (s, w) = grouping_set(item, depth + 1);
        (sets.saturating_mul(s), width.saturating_add(w))
    });
    if sets <= 1 {
        return 0;
    }
    sets.saturating_mul(width.max(1))
}

/// One item of a GROUP BY clause: its sets and its width.
fn grouping_set(item: &serde_json::Value, depth: usize) -> (u64, u64) {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return (u64::MAX, u64::MAX);
    }
    let Some(set) = item.pointer("/node/GroupingSet") else {
        // `(a, b)` in a grouping set is one set of both (a row, as parsed).
        let row = item
            .pointer("/node/RowExpr/args")
            .and_then(Value::as_array)
            .map_or(1, |args| args.len() as u64);
        return (1, row.max(1));
    };
    let content = set
        .get("content")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let members: Vec<(u64, u64)> = content.iter().map(|c| grouping_set(c, depth + 1)).collect();
    let width = members.iter().fold(0u64, |n, (_, w)| n.saturating_add(*w));
    match set.get("kind").and_then(Value::as_i64).unwrap_or(0) {
        // GROUPING_SET_EMPTY
        1 => (1, 0),
        // GROUPING_SET_ROLLUP
        3 => ((members.len() as u64).saturating_add(1), width),
        // GROUPING_SET_CUBE
        4 => (
            1u64.checked_shl(members.len().min(63) as u32)
                .unwrap_or(u64::MAX),
            width,
        ),
        // GROUPING_SET_SETS: each member's sets
        5 => (
            members.iter().fold(0u64, |n, (s, _)| n.saturating_add(*s)),
            width,
        ),
        // GROUPING_SET_SIMPLE (a parenthesized list) and anything else: one set.
        _ => (1, width),
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
