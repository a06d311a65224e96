//! The claim pipeline's pure parts: `judge` and the claim statement.

use super::*;

/// Whatever the handler answers after a statement of its failed: a statement past the
/// server's own limits fails the delivery for good; a serialization failure retries the
/// transaction; any other database error leaves the handler's answer standing.
#[test]
fn a_statement_past_the_servers_limits_fails_for_good_whatever_the_handler_answers() {
    let poison = |code: &str| Failure {
        past_limits: code.starts_with("54"),
        sqlstate: Some(code.into()),
        ..Failure::new(
            pg::classify_sqlstate(code),
            Rollback::Database,
            format!("{code}: failed"),
        )
    };
    let answers = || {
        [
            Ok(()),
            Err(HandlerError::Retryable("again".into())),
            Err(HandlerError::Terminal("never".into())),
        ]
    };
    for (code, answer, kind) in [
        ("54000", 0, FailureKind::Terminal),
        ("54000", 1, FailureKind::Terminal),
        ("54000", 2, FailureKind::Terminal),
        ("54001", 1, FailureKind::Terminal),
        ("40001", 2, FailureKind::RetryTransaction),
        ("23505", 1, FailureKind::Retryable),
        ("23505", 0, FailureKind::Terminal),
        ("53200", 1, FailureKind::Retryable),
        ("53200", 2, FailureKind::Terminal),
        ("57014", 0, FailureKind::Retryable),
    ] {
        let [a, b, c] = answers();
        let answer = [a, b, c].into_iter().nth(answer).unwrap();
        let failure = judge(answer, Some(poison(code))).unwrap();
        assert_eq!(failure.kind, kind, "{code}");
    }
}

/// Every row of `judge`: the handler's answer (none, ok, retryable, terminal) against the
/// first failure its statements met (none, a conflict, a data error, a lock wait given
/// up, the server away): the kind, the cause, the text and the SQLSTATE the attempt fails
/// with, the flags kept from the statement.
#[test]
fn judge_keeps_the_statements_failure_and_weighs_the_handlers_answer() {
    use FailureKind::{RetryTransaction, Retryable, Terminal};
    use Rollback::{Conflict, Database, HandlerRetryable, HandlerTerminal};
    let statement = |code: &str| {
        let kind = pg::classify_sqlstate(code);
        Failure {
            sqlstate: Some(code.into()),
            past_limits: code.starts_with("54"),
            lock_wait: code == "55P03",
            unavailable: code == "57P01",
            ..Failure::new(kind, Database, format!("{code}: failed"))
        }
    };
    let answer = |a: &str| match a {
        "ok" => Ok(()),
        "retry" => Err(HandlerError::Retryable("handler: retry".into())),
        _ => Err(HandlerError::Terminal("handler: never".into())),
    };
    let ok_after =
        |code: &str| format!("handler returned ok after a database error: {code}: failed");
    for (answer_of, code, kind, cause, reason) in [
        (
            "retry",
            None,
            Retryable,
            HandlerRetryable,
            "handler: retry".to_string(),
        ),
        (
            "never",
            None,
            Terminal,
            HandlerTerminal,
            "handler: never".to_string(),
        ),
        (
            "ok",
            Some("40001"),
            RetryTransaction,
            Conflict,
            "40001: failed".to_string(),
        ),
        (
            "never",
            Some("40P01"),
            RetryTransaction,
            Conflict,
            "40P01: failed".to_string(),
        ),
        ("ok", Some("22012"), Terminal, Database, ok_after("22012")),
        (
            "retry",
            Some("22012"),
            Retryable,
            Database,
            "handler: retry".to_string(),
        ),
        (
            "never",
            Some("23505"),
            Terminal,
            Database,
            "handler: never".to_string(),
        ),
        ("ok", Some("55P03"), Retryable, Database, ok_after("55P03")),
        (
            "retry",
            Some("57P01"),
            Retryable,
            Database,
            "handler: retry".to_string(),
        ),
        (
            "ok",
            Some("54000"),
            Terminal,
            Database,
            "54000: failed".to_string(),
        ),
    ] {
        let failure = judge(answer(answer_of), code.map(statement))
            .unwrap_or_else(|| panic!("{answer_of} {code:?} committed"));
        let row = format!("{answer_of} after {code:?}");
        assert_eq!(failure.kind, kind, "{row}");
        assert_eq!(failure.cause, cause, "{row}");
        assert_eq!(failure.reason, reason, "{row}");
        assert_eq!(failure.sqlstate(), code, "{row}");
        assert_eq!(failure.lock_wait, code == Some("55P03"), "{row}");
        assert_eq!(failure.unavailable, code == Some("57P01"), "{row}");
    }
    assert!(judge(Ok(()), None).is_none(), "ok with no failure commits");
}

#[test]
fn the_claim_is_the_patterns_insert() {
    assert_eq!(
        CLAIM_SQL,
        "INSERT INTO processed_message (consumer_name, message_id) VALUES ($1, $2) \
         ON CONFLICT DO NOTHING RETURNING message_id"
    );
    // The function the host calls runs that statement on the bound values.
    let migration = include_str!("../../../migrations/0006_plugin_wall.sql");
    let body: String = migration.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(body.contains(
        "INSERT INTO %1$I.processed_message (consumer_name, message_id) VALUES (p_consumer, p_id) \
         ON CONFLICT DO NOTHING RETURNING message_id INTO claimed;"
    ));
}

/// A handler that is never called: the futures below are made, never polled.
struct Idle;

impl Handler for Idle {
    fn handle<'a>(&'a self, _: &'a TxHandle, _: &'a Message) -> crate::HandleFuture<'a> {
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        "idle".into()
    }
}

/// A delivery's future is the state its task keeps while the transaction runs, and the task is
/// copied whole when it is spawned: it stays a few kilobytes. It held the pool's `acquire` (which
/// may open a connection: ~15 KB) inline, though kept connections serve nearly every delivery,
/// and every delivery's task was 34 KB.
#[tokio::test]
async fn a_deliverys_future_stays_small() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:9/nothing")
        .expect("a lazy pool");
    let claimer = Claimer::new(pool, ClaimSettings::new("c", Isolation::ReadCommitted));
    let msg = Message {
        id: "m".into(),
        subject: "s".into(),
        event_type: None,
        headers: Vec::new(),
        payload: bytes::Bytes::new(),
        delivery_attempt: 1,
    };
    let msgs = [msg.clone(), msg.clone()];
    let one = std::mem::size_of_val(&claimer.process(&Idle, &msg));
    let group = std::mem::size_of_val(&claimer.process_batch(&Idle, &msgs));
    assert!(one <= 4096, "one delivery's future: {one} bytes");
    assert!(group <= 4096, "a group's future: {group} bytes");
}
