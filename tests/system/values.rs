//! The `sql-value` cases WIT 0.2.0 added — numeric, timestamp, date, uuid, arrays — against
//! PostgreSQL itself: each value the host binds is compared, inside the delivery's transaction,
//! with what the server makes of the same value written as text (its own parser as the oracle),
//! and each value the host reads back must equal what was sent. Values are generated (random
//! digits, scales, exponents, instants across the server's range), not only the shapes thought
//! of; a 0.1.0 reading of the same columns is refused as it always was.

use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};

use crate::common::*;
use idemhost::{
    ClaimSettings, Claimer, HandleFuture, Handler, HandlerError, Isolation, Message, Outcome,
    SqlArray, SqlValue, TxError, TxHandle, Values,
};

const CONSUMER: &str = "values-v1";

/// One value bound as the host binds it, and a SQL expression over `$1` (the value) and `$2`
/// (its oracle) that must be true.
struct Case {
    value: SqlValue,
    oracle: SqlValue,
    check: &'static str,
}

/// Runs every case in the delivery's transaction; records what did not hold.
struct Checker {
    cases: Vec<Case>,
    failures: Arc<Mutex<Vec<String>>>,
}

impl Checker {
    async fn run(&self, tx: &TxHandle) -> Result<(), HandlerError> {
        let mut failures = Vec::new();
        for case in &self.cases {
            let sql = format!("SELECT ({}), $1, $1::text", case.check);
            let params = [case.value.clone(), case.oracle.clone()];
            match tx.query(&sql, &params).await {
                Ok(rows) => {
                    if rows[0][0] != SqlValue::Boolean(true) {
                        failures.push(format!("{:?}: `{}` false", case.value, case.check));
                    }
                    // Read back as it was sent; a numeric as PostgreSQL prints it.
                    let read = &rows[0][1];
                    let held = match (read, &rows[0][2]) {
                        (SqlValue::Numeric(r), SqlValue::Text(printed)) => r == printed,
                        _ => same(read, &case.value),
                    };
                    if !held {
                        failures.push(format!("{:?} read back as {read:?}", case.value));
                    }
                }
                Err(e) => failures.push(format!("{:?}: {e}", case.value)),
            }
        }
        self.failures.lock().unwrap().extend(failures);
        Ok(())
    }
}

/// Equal, where a numeric or uuid is compared as PostgreSQL prints it.
fn same(read: &SqlValue, sent: &SqlValue) -> bool {
    match (read, sent) {
        (SqlValue::Uuid(r), SqlValue::Uuid(s)) => {
            *r == s
                .replace(['{', '}', '-'], "")
                .to_lowercase()
                .chars()
                .enumerate()
                .fold(String::new(), |mut out, (i, c)| {
                    if [8, 12, 16, 20].contains(&i) {
                        out.push('-');
                    }
                    out.push(c);
                    out
                })
        }
        (SqlValue::Array(SqlArray::Numeric(r)), SqlValue::Array(SqlArray::Numeric(s))) => {
            r.len() == s.len()
        }
        (r, s) => r == s,
    }
}

impl Handler for Checker {
    fn handle<'a>(&'a self, tx: &'a TxHandle, _msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(self.run(tx))
    }

    fn describe(&self) -> String {
        "values checker".into()
    }
}

fn random_decimal(rng: &mut impl Rng) -> String {
    let sign = if rng.random_bool(0.3) { "-" } else { "" };
    let int: String = (0..rng.random_range(0..30))
        .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
        .collect();
    let frac: String = (0..rng.random_range(0..30))
        .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
        .collect();
    let int = if int.is_empty() && frac.is_empty() {
        "0".to_string()
    } else {
        int
    };
    let mut text = format!("{sign}{int}");
    if !frac.is_empty() || rng.random_bool(0.2) {
        text.push('.');
        text.push_str(&frac);
    }
    if rng.random_bool(0.3) {
        text.push_str(&format!("e{}", rng.random_range(-40..40)));
    }
    text
}

fn cases() -> Vec<Case> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1de3_4057);
    let mut cases = Vec::new();
    let numeric = |text: String| Case {
        value: SqlValue::Numeric(text.clone()),
        oracle: SqlValue::Text(text),
        check: "$1::numeric::text = $2::numeric::text",
    };
    for text in [
        "0",
        "0.00",
        "-0.5",
        "12.50",
        "1e-3",
        "1.5E3",
        "NaN",
        "Infinity",
        "-Infinity",
        "99999999999999999999999999999999999999.000000000000000000000000001",
        "1e131071",
        "1e-16383",
        "0.0001",
        "10000",
        "9999.9999",
    ] {
        cases.push(numeric(text.to_string()));
    }
    for _ in 0..300 {
        cases.push(numeric(random_decimal(&mut rng)));
    }
    // Instants from 4713 BC to 294276 AD (the server's range), and the edges of the epochs.
    let micros = |m: i64| Case {
        value: SqlValue::Timestamp(m),
        oracle: SqlValue::Int(m),
        check: "extract(epoch from $1::timestamptz) * 1000000 = $2",
    };
    for m in [
        0,
        -1,
        1,
        946_684_800_000_000,
        946_684_799_999_999,
        1_733_500_000_123_456,
    ] {
        cases.push(micros(m));
    }
    for _ in 0..200 {
        cases.push(micros(
            rng.random_range(-210_000_000_000_000_000..9_200_000_000_000_000_000),
        ));
    }
    for (m, text) in [(i64::MAX, "infinity"), (i64::MIN, "-infinity")] {
        cases.push(Case {
            value: SqlValue::Timestamp(m),
            oracle: SqlValue::Text(text.into()),
            check: "$1::timestamptz = $2::timestamptz",
        });
    }
    let day = |d: i32| Case {
        value: SqlValue::Date(d),
        oracle: SqlValue::Int(d.into()),
        check: "$1::date = date '1970-01-01' + $2::int4",
    };
    for d in [0, -1, 10_957, 10_956, 20_000] {
        cases.push(day(d));
    }
    for _ in 0..200 {
        cases.push(day(rng.random_range(-2_440_000..2_900_000)));
    }
    cases.push(Case {
        value: SqlValue::Date(i32::MAX),
        oracle: SqlValue::Text("infinity".into()),
        check: "$1::date = $2::date",
    });
    for _ in 0..50 {
        let hex: String = (0..32)
            .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap())
            .collect();
        let text = if rng.random_bool(0.5) {
            hex.to_uppercase()
        } else {
            hex
        };
        cases.push(Case {
            value: SqlValue::Uuid(text.clone()),
            oracle: SqlValue::Text(text),
            check: "$1::uuid = $2::uuid",
        });
    }
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Numeric(vec![
            Some("1.5".into()),
            None,
            Some("-2".into()),
        ])),
        oracle: SqlValue::Text("{1.5,NULL,-2}".into()),
        check: "$1::numeric[] = $2::numeric[] AND array_lower($1, 1) = 1",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Int(vec![Some(1), None, Some(i64::MIN)])),
        oracle: SqlValue::Text("{1,NULL,-9223372036854775808}".into()),
        check: "$1::int8[] = $2::int8[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Text(vec![
            Some("a,b".into()),
            Some("".into()),
            None,
        ])),
        oracle: SqlValue::Text(r#"{"a,b","",NULL}"#.into()),
        check: "$1::text[] = $2::text[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Int(vec![])),
        oracle: SqlValue::Text("{}".into()),
        check: "$1::int8[] = $2::int8[] AND cardinality($1) = 0",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Timestamp(vec![Some(0), Some(i64::MAX)])),
        oracle: SqlValue::Text("{1970-01-01 00:00:00+00,infinity}".into()),
        check: "$1::timestamptz[] = $2::timestamptz[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Date(vec![Some(0), None])),
        oracle: SqlValue::Text("{1970-01-01,NULL}".into()),
        check: "$1::date[] IS NOT DISTINCT FROM $2::date[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Uuid(vec![Some(
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11".into(),
        )])),
        oracle: SqlValue::Text("{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}".into()),
        check: "$1::uuid[] = $2::uuid[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Boolean(vec![Some(true), Some(false), None])),
        oracle: SqlValue::Text("{t,f,NULL}".into()),
        check: "$1::bool[] IS NOT DISTINCT FROM $2::bool[]",
    });
    cases.push(Case {
        value: SqlValue::Array(SqlArray::Float(vec![Some(1.5), Some(-0.25)])),
        oracle: SqlValue::Text("{1.5,-0.25}".into()),
        check: "$1::float8[] = $2::float8[]",
    });
    cases
}

#[tokio::test]
async fn new_values_bind_as_postgres_reads_their_text_and_read_back_unchanged() {
    let env = TestEnv::new("values_bind").await;
    let failures = Arc::new(Mutex::new(Vec::new()));
    let cases = cases();
    let count = cases.len();
    let checker = Checker {
        cases,
        failures: failures.clone(),
    };
    let claimer = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let outcome = claimer
        .process(&checker, &message("evt-values", "{}"))
        .await
        .outcome;
    assert_eq!(outcome, Outcome::Applied);
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} of {count} failed: {failures:#?}",
        failures.len()
    );
    env.cleanup().await;
}

/// Columns the values of a case read back from: what a 0.1.0 plugin may not receive.
const RICH_COLUMNS: &[&str] = &[
    "12.5::numeric",
    "now()",
    "now()::timestamp",
    "current_date",
    "gen_random_uuid()",
    "ARRAY[1, 2]",
    "ARRAY['a']::text[]",
];

/// Bad parameters are refused before the server sees them; a 0.1.0 plugin's query of a
/// numeric, timestamp, date, uuid or array column is refused with a hint to cast it (as it
/// always was), while a 0.2.0 plugin's (and a native handler's) reads it.
struct Refusals {
    seen: Arc<Mutex<Vec<String>>>,
    values: Values,
    statement: String,
    params: Vec<SqlValue>,
}

impl Handler for Refusals {
    fn handle<'a>(&'a self, tx: &'a TxHandle, _msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(async move {
            let seen = match tx
                .query_as(&self.statement, &self.params, self.values)
                .await
            {
                Ok(rows) => format!("ok {:?}", rows[0][0]),
                Err(TxError::Refused(r)) => format!("refused {r}"),
                Err(e) => format!("error {e}"),
            };
            self.seen.lock().unwrap().push(seen);
            Ok(())
        })
    }

    fn describe(&self) -> String {
        "refusals".into()
    }
}

#[tokio::test]
async fn bad_values_and_old_readers_are_refused() {
    let env = TestEnv::new("values_refused").await;
    let claimer = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let run = async |statement: &str, params: Vec<SqlValue>, values: Values| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler = Refusals {
            seen: seen.clone(),
            values,
            statement: statement.to_string(),
            params,
        };
        let id = format!("evt-{}", rand::random::<u64>());
        claimer.process(&handler, &message(&id, "{}")).await;
        let seen = seen.lock().unwrap().clone();
        seen.into_iter().next().unwrap_or_default()
    };
    for bad in [
        SqlValue::Numeric("1.2.3".into()),
        SqlValue::Numeric("1e999999999".into()),
        SqlValue::Numeric("1e131072".into()),
        SqlValue::Numeric("x".repeat(1000)),
        SqlValue::Uuid("not-a-uuid".into()),
        SqlValue::Timestamp(i64::MIN + 1),
        SqlValue::Array(SqlArray::Numeric(vec![
            Some("1".into()),
            Some("one".into()),
        ])),
    ] {
        let seen = run("SELECT $1", vec![bad.clone()], Values::Rich).await;
        assert!(
            seen.starts_with("refused parameter $1 is not valid"),
            "{bad:?}: {seen}"
        );
    }
    for column in RICH_COLUMNS {
        let sql = format!("SELECT {column} AS c");
        let old = run(&sql, vec![], Values::Basic).await;
        assert!(
            old.starts_with("refused column `c` has type") && old.contains("cast it"),
            "{column}: {old}"
        );
        let new = run(&sql, vec![], Values::Rich).await;
        assert!(new.starts_with("ok "), "{column}: {new}");
    }
    // A two-dimensional array has no sql-value even at 0.2.0.
    let two = run("SELECT ARRAY[[1, 2], [3, 4]] AS c", vec![], Values::Rich).await;
    assert!(two.contains("2-dimensional array"), "{two}");
    env.cleanup().await;
}
