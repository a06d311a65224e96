//! Values the planner folds into constants and then copies or estimates element by element,
//! without checking for cancellation: the operands of array comparisons and the functions of
//! a FROM list a plugin statement may use.

use super::{MAX_DEPTH, string_node};

/// Refuses `op ANY (array)`, `op ALL (array)` and the array containment operators (`@>`, `<@`,
/// `&&`) over an array the planner would fold from a function call or a cast of one
/// (`array_fill(0::oid, ARRAY[4000000])`, `string_to_array(repeat(...), ',')`): it estimates
/// the selectivity of every element while planning, without checking for cancellation (75
/// bytes ran 34 s and took 1.1 GB past a 1 s statement timeout). A constant, a parameter, an
/// `ARRAY[...]` (bounded by the statement's tokens), a column or a subquery may be compared.
pub(super) fn check_array_operands(expr: &serde_json::Value) -> Result<(), String> {
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

/// Set-returning functions a FROM list may call with no column definition list: the planner
/// never folds a set-returning call into a constant.
const FROM_SET_RETURNING: &[&str] = &[
    "generate_series",
    "generate_subscripts",
    "unnest",
    "json_array_elements",
    "json_array_elements_text",
    "jsonb_array_elements",
    "jsonb_array_elements_text",
    "json_each",
    "json_each_text",
    "jsonb_each",
    "jsonb_each_text",
    "json_object_keys",
    "jsonb_object_keys",
    "json_to_recordset",
    "jsonb_to_recordset",
    "json_populate_recordset",
    "jsonb_populate_recordset",
    "jsonb_path_query",
    "regexp_matches",
    "regexp_split_to_table",
    "string_to_table",
];

/// Refuses a function in a FROM list the planner may fold into one constant value and copy,
/// whole, into every reference to it while it plans, without checking for cancellation (a
/// 48 MB `repeat(...)` referenced 20 times: 1 GB, 0.8 s past a 100 ms timeout; a 1 GB value
/// referenced a few dozen times exhausts any server): a call whose arguments are all constants
/// or parameters. A known set-returning function passes, and so do a call without arguments,
/// a call on a column (`LATERAL upper(t.v)`: not a constant) and a call with a column
/// definition list of two or more columns (a composite result is not folded:
/// `jsonb_to_record($1) AS r (id int, name text)`).
pub(super) fn check_from_functions(from: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let columns = |list: Option<&Value>| list.and_then(Value::as_array).map_or(0, Vec::len);
    let own_columns = columns(from.get("coldeflist"));
    let functions = from
        .get("functions")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    for function in functions {
        let items = function
            .pointer("/node/List/items")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let expression = items.first();
        let call = expression.and_then(|c| c.pointer("/node/FuncCall"));
        let arguments = match call {
            Some(c) => c.get("args").and_then(Value::as_array).map_or(0, Vec::len),
            None => 1,
        };
        let on_a_column = expression.is_some_and(|e| names_a_column(e, 0));
        let defined = columns(items.get(1).and_then(|l| l.pointer("/node/List/items")));
        let name: Vec<String> = call
            .and_then(|c| c.get("funcname"))
            .and_then(Value::as_array)
            .map(|parts| parts.iter().map(string_node).collect())
            .unwrap_or_default();
        let set_returning = match name.as_slice() {
            [f] | [_, f] if name.len() == 1 || name[0] == "pg_catalog" => {
                FROM_SET_RETURNING.contains(&f.to_lowercase().as_str())
            }
            _ => false,
        };
        if !set_returning && defined.max(own_columns) < 2 && arguments > 0 && !on_a_column {
            let shown = name.last().map_or("this expression", String::as_str);
            return Err(format!(
                "statement refused: `{}` in a FROM list: only a set-returning function \
                 (generate_series, unnest, jsonb_array_elements, …) or a call with a column \
                 definition list of two or more columns may be called there; the server folds \
                 any other into one value and copies it into every reference, \
                 uninterruptibly (call it in the select list)",
                crate::text::reason(shown)
            ));
        }
    }
    Ok(())
}

/// Whether an expression references a column anywhere in it (then it is not a constant).
fn names_a_column(value: &serde_json::Value, depth: usize) -> bool {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return false;
    }
    match value {
        Value::Array(items) => items.iter().any(|v| names_a_column(v, depth + 1)),
        Value::Object(fields) => {
            fields.contains_key("ColumnRef")
                || fields.values().any(|v| names_a_column(v, depth + 1))
        }
        _ => false,
    }
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
