//! Property tests of the gate: it never panics, and no decoration (case, comments, whitespace,
//! quoting, schema qualification, a statement hidden after `;`) slips a refused statement past
//! it, while literals never cause a refusal.

use proptest::prelude::*;

use super::{HOST_RELATIONS as RESERVED, check};

/// Functions refused however they are spelled.
const RESERVED_FUNCTIONS: &[&str] = &[
    "set_config",
    "query_to_xml",
    "pg_advisory_lock",
    "lo_export",
    "lo_from_bytea",
    "pg_read_file",
    "idemhost_claim",
    "pg_terminate_backend",
    "ts_stat",
];

/// Statements the gate must refuse, whatever surrounds them.
const REFUSED: &[&str] = &[
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT s",
    "SET ROLE postgres",
    "SET session_authorization postgres",
    "RESET ALL",
    "LISTEN x",
    "COPY inventory TO PROGRAM 'cat'",
    "DELETE FROM processed_message",
    "TRUNCATE processed_message",
    "ALTER TABLE processed_message DROP COLUMN message_id",
    "DROP TABLE processed_message",
    "SELECT set_config('statement_timeout', '0', true)",
    "DO $$ BEGIN END $$",
];

/// Statements the gate lets through.
const ALLOWED: &[&str] = &[
    "SELECT 1",
    "UPDATE inventory SET reserved = reserved + $1 WHERE sku = $2",
    "INSERT INTO orders (id) VALUES ($1) ON CONFLICT DO NOTHING",
    "WITH x AS (SELECT 1) SELECT * FROM x",
    "DELETE FROM inventory WHERE sku = $1",
];

/// Whitespace and comments, which PostgreSQL ignores between tokens.
fn filler() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just(" ".to_string()),
            Just("\n\t".to_string()),
            "[a-z ;']{0,12}".prop_map(|t| format!("/* {} */", t.replace("*/", ""))),
            "[a-z ;']{0,12}".prop_map(|t| format!("-- {t}\n")),
            Just("/* nested /* comment */ still */".to_string()),
        ],
        0..4,
    )
    .prop_map(|parts| parts.concat())
}

/// `sql` with its words' case scrambled by `mask`, outside quotes.
fn scramble_case(sql: &str, mask: u64) -> String {
    let mut quoted = false;
    sql.chars()
        .enumerate()
        .map(|(i, c)| {
            if c == '\'' || c == '"' || c == '$' {
                quoted = !quoted;
            }
            if !quoted && (mask >> (i % 64)) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

/// Ways to name a table that all reach the same relation.
fn spell(name: &str, how: u8) -> String {
    match how % 6 {
        0 => name.to_string(),
        1 => format!("\"{name}\""),
        2 => format!("public.{name}"),
        3 => format!("public.\"{name}\""),
        4 => format!("U&\"{}\"", name.replace('_', "\\005f")),
        _ => name.to_uppercase(),
    }
}

/// A literal PostgreSQL reads back as `text`, in one of the quoting styles.
fn literal(text: &str, how: u8) -> String {
    match how % 3 {
        2 if !text.contains('$') => format!("$q${text}$q$"),
        1 => format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "\\'")),
        _ => format!("'{}'", text.replace('\'', "''")),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Any text at all: an answer, never a panic.
    #[test]
    fn never_panics_on_any_text(sql in any::<String>()) {
        let _ = check(&sql);
    }

    /// Text built from the characters the scanner treats specially: quotes, dollars, comment
    /// markers, semicolons, multibyte letters.
    #[test]
    fn never_panics_on_sql_punctuation(sql in "[a-zA-Z0-9_$'\";*/\\-\\\\ \n&é€]{0,64}") {
        let _ = check(&sql);
    }

    #[test]
    fn refused_statements_stay_refused_when_decorated(
        i in 0..REFUSED.len(),
        before in filler(),
        after in filler(),
        mask in any::<u64>(),
        semicolon in any::<bool>(),
    ) {
        let sql = format!(
            "{before}{}{}{after}",
            scramble_case(REFUSED[i], mask),
            if semicolon { ";" } else { "" }
        );
        prop_assert!(check(&sql).is_err(), "passed: {sql:?}");
    }

    #[test]
    fn a_second_statement_is_always_refused(
        a in 0..ALLOWED.len(),
        b in 0..(ALLOWED.len() + REFUSED.len()),
        between in filler(),
    ) {
        let second = ALLOWED.iter().chain(REFUSED).nth(b).copied().unwrap_or("SELECT 1");
        let sql = format!("{};{between}{second}", ALLOWED[a]);
        prop_assert!(check(&sql).is_err(), "passed: {sql:?}");
    }

    #[test]
    fn reserved_names_are_refused_however_spelled(
        r in 0..RESERVED.len(),
        f in 0..RESERVED_FUNCTIONS.len(),
        how in any::<u8>(),
        stmt in 0..5u8,
        around in filler(),
    ) {
        let name = spell(RESERVED[r], how);
        let function = spell(RESERVED_FUNCTIONS[f], how);
        let sql = match stmt {
            0 => format!("SELECT * FROM {around}{name}"),
            1 => format!("DELETE FROM {name}{around} WHERE true"),
            2 => format!("WITH d AS (UPDATE {name} SET x = 1 RETURNING 1) SELECT 1"),
            3 => format!("SELECT {function}({around}'x', 'y', true)"),
            _ => format!("SELECT * FROM inventory WHERE sku IN (SELECT {function}({around}1))"),
        };
        prop_assert!(check(&sql).is_err(), "passed: {sql:?}");
    }

    /// Whatever a literal holds (statements, reserved names, quotes, semicolons), it is data.
    #[test]
    fn literals_never_cause_a_refusal(
        text in "[a-zA-Z0-9_ ;'\"$*/\\-\\\\]{0,40}",
        how in any::<u8>(),
    ) {
        let sql = format!("SELECT {} FROM inventory WHERE sku = $1", literal(&text, how));
        prop_assert_eq!(check(&sql), Ok(()), "refused: {:?}", sql);
    }
}
