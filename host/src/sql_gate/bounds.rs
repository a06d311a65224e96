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
