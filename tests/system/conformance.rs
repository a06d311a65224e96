//! One conformance suite for every plugin language: the same cases run against the Rust,
//! Python, JavaScript and C builds of the seed's inventory handler, of the plugin template
//! (`plugins/templates/<lang>`) and of the conformance cases (`plugins/conformance/<lang>`), all
//! loaded by the same host, and every case checks database state by SQL. Those target
//! idemhost:consumer@0.2.0; beside them the same cases run against components built for 0.1.0
//! (`tests/fixtures/wit-0.1.0`: the templates as they were, the Rust and C ones as built then),
//! which the host runs unchanged. Test names read `<case>::<language>` and
//! `<case>::<language>_wit_0_1`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::common::*;
use idemhost::{
    ClaimSettings, Claimer, Host, Isolation, Message, Outcome, PluginLimits, WasmHandler,
};

const CONSUMER: &str = "inventory-reservation-v1";
/// Short enough for the busy-loop case, long enough for an interpreter's slowest call here.
const HANDLER_TIMEOUT: Duration = Duration::from_millis(1500);

/// Generates `mod <case> { rust, python, javascript, c }`, one test per language.
macro_rules! for_each_language {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            #[tokio::test]
            async fn rust() { super::$case("rust").await }
            #[tokio::test]
            async fn python() { super::$case("py").await }
            #[tokio::test]
            async fn javascript() { super::$case("js").await }
            #[tokio::test]
            async fn c() { super::$case("c").await }
        }
    )*};
}

/// Generates `mod <case> { rust, ..., c, rust_wit_0_1, ..., c_wit_0_1 }`: the case against each
/// language's 0.2.0 build and against its 0.1.0 fixture.
macro_rules! for_each_build {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            use super::Wit::{V0_1, V0_2};
            #[tokio::test]
            async fn rust() { super::$case("rust", V0_2).await }
            #[tokio::test]
            async fn python() { super::$case("py", V0_2).await }
            #[tokio::test]
            async fn javascript() { super::$case("js", V0_2).await }
            #[tokio::test]
            async fn c() { super::$case("c", V0_2).await }
            #[tokio::test]
            async fn rust_wit_0_1() { super::$case("rust", V0_1).await }
            #[tokio::test]
            async fn python_wit_0_1() { super::$case("py", V0_1).await }
            #[tokio::test]
            async fn javascript_wit_0_1() { super::$case("js", V0_1).await }
            #[tokio::test]
            async fn c_wit_0_1() { super::$case("c", V0_1).await }
        }
    )*};
}

/// The WIT version a build targets.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Wit {
    V0_1,
    V0_2,
}

impl Wit {
    fn tag(self) -> &'static str {
        match self {
            Wit::V0_1 => "w01",
            Wit::V0_2 => "w02",
        }
    }
}

for_each_language!(
    applies_once_and_acks_the_duplicate,
    business_failure_rolls_back_and_the_id_applies_later,
    malformed_payloads_are_terminal_without_effect,
    well_formed_edge_cases_parse_like_rust,
    bad_json_is_dead_lettered_through_nats,
    a_unique_violation_arrives_typed_and_the_plugin_makes_it_terminal,
    the_template_reads_its_limit_from_the_consumer_config,
    component_imports_only_granted_interfaces,
);

for_each_build!(
    refused_sql_reaches_the_plugin_as_an_error,
    trap_is_retryable_and_rolls_back,
    busy_loop_is_cut_at_the_deadline,
    template_records_a_business_key_once,
    retryable_errors_roll_back,
    no_state_survives_from_one_delivery_to_the_next,
);

fn inventory_name(lang: &str) -> String {
    match lang {
        "rust" => "inventory".into(),
        other => format!("inventory-{other}"),
    }
}

fn template_name(lang: &str) -> String {
    format!("template-{lang}")
}

/// The build holding the conformance cases: at 0.2.0 `plugins/conformance/<lang>`, at 0.1.0 the
/// template as it was (it held the cases then).
fn conformance_name(lang: &str, wit: Wit) -> String {
    match wit {
        Wit::V0_2 => format!("conformance-{lang}"),
        Wit::V0_1 => fixture_name(lang),
    }
}

/// The template's build: at 0.1.0 the fixture.
fn template_build(lang: &str, wit: Wit) -> String {
    match wit {
        Wit::V0_2 => template_name(lang),
        Wit::V0_1 => fixture_name(lang),
    }
}

/// A 0.1.0 component: Rust and C as built then and committed (`fixture/`), Python and JavaScript
/// (megabytes each) built from the sources kept beside them.
fn fixture_name(lang: &str) -> String {
    match lang {
        "rust" | "c" => format!("fixture/template-{lang}"),
        other => format!("template-{other}-0.1"),
    }
}

fn component_path(name: &str) -> std::path::PathBuf {
    match name.strip_prefix("fixture/") {
        Some(file) => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/wit-0.1.0")
            .join(format!("{file}.wasm")),
        None => plugin_path(name),
    }
}

/// One loaded handler per component for the whole test binary (the runtime's compile cache
/// spares later test binaries and re-runs the compilation too).
fn plugin(name: &str) -> Arc<WasmHandler> {
    type Cells = Mutex<HashMap<String, Arc<OnceLock<Arc<WasmHandler>>>>>;
    static LOADED: OnceLock<Cells> = OnceLock::new();
    let cell = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(name.to_string())
        .or_default()
        .clone();
    cell.get_or_init(|| {
        let limits = PluginLimits {
            timeout: HANDLER_TIMEOUT,
            memory: 64 << 20,
        };
        Arc::new(runtime().load(&component_path(name), limits).unwrap())
    })
    .clone()
}

fn claimer(env: &TestEnv) -> Claimer {
    Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    )
}

fn event(id: &str, event_type: &str, payload: &[u8]) -> Message {
    Message {
        event_type: Some(event_type.into()),
        payload: payload.to_vec().into(),
        ..message(id, "")
    }
}

#[track_caller]
fn assert_terminal(outcome: &Outcome, prefix: &str) {
    assert!(
        matches!(outcome, Outcome::TerminalFailure(r) if r.starts_with(prefix)),
        "expected a terminal failure starting {prefix:?}, got {outcome:?}"
    );
}

async fn applies_once_and_acks_the_duplicate(lang: &str) {
    let env = TestEnv::new(&format!("conf_dup_{lang}")).await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let (p, c) = (plugin(&inventory_name(lang)), claimer(&env));
    let msg = message("evt-1", &order_payload("evt-1", "sku-1", 3));
    assert_eq!(c.process(p.as_ref(), &msg).await.outcome, Outcome::Applied);
    assert_eq!(
        c.process(p.as_ref(), &msg).await.outcome,
        Outcome::Duplicate
    );
    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(
        (env.available("sku-1").await, env.reserved("sku-1").await),
        (7, 3)
    );
    env.cleanup().await;
}

async fn business_failure_rolls_back_and_the_id_applies_later(lang: &str) {
    let env = TestEnv::new(&format!("conf_biz_{lang}")).await;
    env.seed_inventory(&[("sku-1", 2)]).await;
    let (p, c) = (plugin(&inventory_name(lang)), claimer(&env));
    let msg = message("evt-big", &order_payload("evt-big", "sku-1", 5));
    let outcome = c.process(p.as_ref(), &msg).await.outcome;
    assert_terminal(
        &outcome,
        "Unknown SKU or insufficient inventory for order-evt-big",
    );
    let outcome = c
        .process(
            p.as_ref(),
            &message("evt-zero", &order_payload("evt-zero", "sku-1", 0)),
        )
        .await
        .outcome;
    assert_terminal(&outcome, "quantity must be positive for order-evt-zero");
    let unknown = message("evt-unknown", &order_payload("evt-unknown", "sku-404", 1));
    let outcome = c.process(p.as_ref(), &unknown).await.outcome;
    assert_terminal(&outcome, "Unknown SKU or insufficient inventory");
    assert_eq!(
        env.markers(CONSUMER).await,
        0,
        "no marker without its effect"
    );
    assert_eq!(
        (env.available("sku-1").await, env.reserved("sku-1").await),
        (2, 0)
    );

    // The failed attempt left no false duplicate: once stock arrives, the same id applies.
    sqlx::query("UPDATE inventory SET available = 10 WHERE sku = 'sku-1'")
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(c.process(p.as_ref(), &msg).await.outcome, Outcome::Applied);
    assert_eq!(
        (env.available("sku-1").await, env.reserved("sku-1").await),
        (5, 5)
    );
    assert_eq!(env.markers(CONSUMER).await, 1);
    env.cleanup().await;
}

/// Payloads the Rust plugin's serde struct refuses; every language refuses them the same way.
const MALFORMED: &[(&str, &[u8])] = &[
    ("not json", b"not json"),
    ("empty", b""),
    ("array", b"[1,2]"),
    (
        "missing field",
        br#"{"id":"e","orderId":"o","sku":"sku-1"}"#,
    ),
    (
        "quantity as string",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":"3"}"#,
    ),
    (
        "quantity as float",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":1.5}"#,
    ),
    (
        "quantity with exponent",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":1e2}"#,
    ),
    (
        "quantity as bool",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":true}"#,
    ),
    (
        "quantity past i64",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":9223372036854775808}"#,
    ),
    (
        "sku as number",
        br#"{"id":"e","orderId":"o","sku":1,"quantity":1}"#,
    ),
    (
        "orderId null",
        br#"{"id":"e","orderId":null,"sku":"sku-1","quantity":1}"#,
    ),
    (
        "duplicate field",
        br#"{"id":"e","orderId":"o","sku":"sku-1","sku":"sku-2","quantity":1}"#,
    ),
    (
        "trailing characters",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":1} x"#,
    ),
    (
        "trailing comma",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":1,}"#,
    ),
    (
        "not UTF-8",
        b"{\"id\":\"e\",\"orderId\":\"o\",\"sku\":\"sku-\xff\",\"quantity\":1}",
    ),
    (
        "lone surrogate",
        br#"{"id":"e","orderId":"o","sku":"\ud800","quantity":1}"#,
    ),
    (
        "single quotes",
        br#"{'id':'e','orderId':'o','sku':'sku-1','quantity':1}"#,
    ),
    (
        "NaN",
        br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":NaN}"#,
    ),
];

async fn malformed_payloads_are_terminal_without_effect(lang: &str) {
    let env = TestEnv::new(&format!("conf_bad_{lang}")).await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let (p, c) = (plugin(&inventory_name(lang)), claimer(&env));
    for (i, (what, payload)) in MALFORMED.iter().enumerate() {
        let msg = event(&format!("evt-bad-{i}"), "OrderPlaced", payload);
        let outcome = c.process(p.as_ref(), &msg).await.outcome;
        assert!(
            matches!(&outcome, Outcome::TerminalFailure(r) if r.starts_with("malformed OrderPlaced payload")),
            "{lang}: {what}: {outcome:?}"
        );
    }
    assert_eq!(env.markers(CONSUMER).await, 0);
    assert_eq!(env.reserved("sku-1").await, 0);
    env.cleanup().await;
}

async fn well_formed_edge_cases_parse_like_rust(lang: &str) {
    let env = TestEnv::new(&format!("conf_edge_{lang}")).await;
    env.seed_inventory(&[("sku-1", 100), ("sku-é", 100)]).await;
    let (p, c) = (plugin(&inventory_name(lang)), claimer(&env));
    let cases: &[(&str, &[u8])] = &[
        ("unknown fields ignored", br#"{"id":"e","orderId":"o","sku":"sku-1","quantity":1,"extra":{"deep":[1,2.5,null,"x"]}}"#),
        ("whitespace", b" \n\t{ \"id\" : \"e\" , \"orderId\":\"o\",\"sku\":\"sku-1\",\"quantity\":2 }\r\n"),
        ("escapes", br#"{"id":"e","orderId":"o","sku":"sku-\u0031","quantity":3}"#),
        ("UTF-8 text", "{\"id\":\"e\",\"orderId\":\"o\",\"sku\":\"sku-é\",\"quantity\":4}".as_bytes()),
        ("escaped UTF-8", br#"{"id":"e","orderId":"o","sku":"sku-\u00e9","quantity":5}"#),
    ];
    for (i, (what, payload)) in cases.iter().enumerate() {
        let msg = event(&format!("evt-edge-{i}"), "OrderPlaced", payload);
        let outcome = c.process(p.as_ref(), &msg).await.outcome;
        assert_eq!(outcome, Outcome::Applied, "{lang}: {what}");
    }
    // i64::MAX parses (it is a valid quantity) and then finds too little stock.
    let huge = br#"{"id":"e","orderId":"o-max","sku":"sku-1","quantity":9223372036854775807}"#;
    let outcome = c
        .process(p.as_ref(), &event("evt-max", "OrderPlaced", huge))
        .await
        .outcome;
    assert_terminal(&outcome, "Unknown SKU or insufficient inventory for o-max");
    assert_eq!(env.markers(CONSUMER).await, 5);
    assert_eq!(env.reserved("sku-1").await, 1 + 2 + 3);
    assert_eq!(env.reserved("sku-é").await, 4 + 5);
    env.cleanup().await;
}

async fn bad_json_is_dead_lettered_through_nats(lang: &str) {
    let env = TestEnv::new(&format!("conf_dlq_{lang}")).await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let nats = NatsEnv::new(&format!("conf_dlq_{lang}"), Duration::from_secs(60)).await;
    let config = config(
        &env,
        &nats,
        CONSUMER,
        &inventory_name(lang),
        "max_in_flight = 4\n",
    );
    let host = RunningHost::start(Host::new(config));
    nats.publish(Some("evt-good"), &order_payload("evt-good", "sku-1", 2))
        .await;
    nats.publish(Some("evt-bad"), "{\"orderId\": ").await;
    // The host compiles the component first (for JavaScript, a 12 MB one): on two busy cores
    // that alone has taken most of 30 s.
    nats.wait_drained(CONSUMER, Duration::from_secs(120)).await;
    host.stop().await;

    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.reserved("sku-1").await, 2);
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let (headers, payload) = &letters[0];
    assert_eq!(payload.as_slice(), b"{\"orderId\": ");
    assert_eq!(
        headers.get("Idemhost-Message-Id").map(|v| v.as_str()),
        Some("evt-bad")
    );
    let reason = headers
        .get("Idemhost-Failure-Reason")
        .map(|v| v.to_string())
        .unwrap_or_default();
    assert!(reason.contains("malformed OrderPlaced payload"), "{reason}");
    nats.cleanup().await;
    env.cleanup().await;
}

async fn template_env(tag: &str, lang: &str) -> TestEnv {
    let env = TestEnv::new(&format!("conf_{tag}_{lang}")).await;
    sqlx::raw_sql(
        "CREATE TABLE note (note_id text PRIMARY KEY, body text NOT NULL, message_id text NOT NULL);
         CREATE TABLE conformance_refusal (message_id text NOT NULL, error text NOT NULL);
         CREATE TABLE conformance_state (message_id text NOT NULL, calls bigint NOT NULL);
         CREATE TABLE conformance_unique (k text PRIMARY KEY, message_id text NOT NULL);",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    env
}

/// The template records the refusal it was given and returns `ok`: the refusal still fails the
/// attempt (its reason names what was refused), and nothing of it commits.
async fn refused_sql_reaches_the_plugin_as_an_error(lang: &str, wit: Wit) {
    let env = template_env("refused", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&conformance_name(lang, wit)), claimer(&env));
    let msg = event("evt-refused", "conformance.refused-sql", b"{}");
    let outcome = c.process(p.as_ref(), &msg).await.outcome;
    assert!(
        matches!(&outcome, Outcome::RetryableFailure(r) if r.contains("refused") && r.contains("processed_message")),
        "{lang}: {outcome:?}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM conformance_refusal").await,
        0,
        "{lang}: the plugin's write after the refusal rolled back"
    );
    assert_eq!(env.markers(CONSUMER).await, 0, "{lang}: no marker");
    env.cleanup().await;
}

async fn trap_is_retryable_and_rolls_back(lang: &str, wit: Wit) {
    let env = template_env("trap", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&conformance_name(lang, wit)), claimer(&env));
    let outcome = c
        .process(p.as_ref(), &event("evt-trap", "conformance.trap", b"{}"))
        .await
        .outcome;
    assert!(
        matches!(&outcome, Outcome::RetryableFailure(r) if r.starts_with("plugin trapped")),
        "{lang}: {outcome:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    // The trap took only its own store with it.
    let note = event(
        "evt-after-trap",
        "NoteAdded",
        br#"{"noteId":"n-1","text":"still here"}"#,
    );
    assert_eq!(c.process(p.as_ref(), &note).await.outcome, Outcome::Applied);
    assert_eq!(env.scalar("SELECT count(*) FROM note").await, 1);
    env.cleanup().await;
}

async fn busy_loop_is_cut_at_the_deadline(lang: &str, wit: Wit) {
    let env = template_env("loop", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&conformance_name(lang, wit)), claimer(&env));
    let started = Instant::now();
    let outcome = c
        .process(
            p.as_ref(),
            &event("evt-loop", "conformance.busy-loop", b"{}"),
        )
        .await
        .outcome;
    let elapsed = started.elapsed();
    assert!(
        matches!(&outcome, Outcome::RetryableFailure(r) if r.contains("handler_timeout")),
        "{lang}: {outcome:?}"
    );
    assert!(elapsed >= HANDLER_TIMEOUT, "{elapsed:?}");
    assert!(
        elapsed < HANDLER_TIMEOUT * 4,
        "interrupted promptly: {elapsed:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    env.cleanup().await;
}

async fn template_records_a_business_key_once(lang: &str, wit: Wit) {
    let env = template_env("note", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&template_build(lang, wit)), claimer(&env));
    let body = br#"{"noteId":"n-7","text":"hello"}"#;
    let first = event("evt-note-a", "NoteAdded", body);
    assert_eq!(
        c.process(p.as_ref(), &first).await.outcome,
        Outcome::Applied
    );
    assert_eq!(
        c.process(p.as_ref(), &first).await.outcome,
        Outcome::Duplicate
    );
    // The same business fact under a second message id: a second marker, still one note.
    let again = event("evt-note-b", "NoteAdded", body);
    assert_eq!(
        c.process(p.as_ref(), &again).await.outcome,
        Outcome::Applied
    );
    assert_eq!(env.markers(CONSUMER).await, 2);
    assert_eq!(
        env.scalar("SELECT count(*) FROM note WHERE note_id = 'n-7' AND message_id = 'evt-note-a'")
            .await,
        1
    );
    assert_eq!(env.scalar("SELECT count(*) FROM note").await, 1);
    let empty = event(
        "evt-note-empty",
        "NoteAdded",
        br#"{"noteId":"n-8","text":""}"#,
    );
    assert_terminal(
        &c.process(p.as_ref(), &empty).await.outcome,
        "noteId and a non-empty text are required",
    );
    let unknown = event("evt-unknown-type", "NoteDeleted", b"{}");
    assert_terminal(
        &c.process(p.as_ref(), &unknown).await.outcome,
        "unknown event type",
    );
    assert_eq!(env.markers(CONSUMER).await, 2);
    env.cleanup().await;
}

async fn retryable_errors_roll_back(lang: &str, wit: Wit) {
    let env = template_env("retry", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&conformance_name(lang, wit)), claimer(&env));
    let outcome = c
        .process(p.as_ref(), &event("evt-retry", "conformance.retry", b"{}"))
        .await
        .outcome;
    assert_eq!(
        outcome,
        Outcome::RetryableFailure("conformance: retry requested".into())
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    // A database error surfaces as retryable too: the note table is gone.
    sqlx::raw_sql("DROP TABLE note")
        .execute(&env.pool)
        .await
        .unwrap();
    let note = event(
        "evt-no-table",
        "NoteAdded",
        br#"{"noteId":"n-1","text":"x"}"#,
    );
    let outcome = c.process(p.as_ref(), &note).await.outcome;
    assert!(
        matches!(&outcome, Outcome::RetryableFailure(r) if r.contains("note")),
        "{lang}: {outcome:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    env.cleanup().await;
}

/// Every delivery runs in a fresh instance: a module-level counter the template bumps on each
/// call reads 1 every time, also after a trap, so nothing of one message's run (nor of its
/// transaction handle) reaches the next.
async fn no_state_survives_from_one_delivery_to_the_next(lang: &str, wit: Wit) {
    let env = template_env("state", &format!("{lang}_{}", wit.tag())).await;
    let (p, c) = (plugin(&conformance_name(lang, wit)), claimer(&env));
    for i in 0..3 {
        let msg = event(&format!("evt-state-{i}"), "conformance.state", b"{}");
        assert_eq!(c.process(p.as_ref(), &msg).await.outcome, Outcome::Applied);
        let trap = event(&format!("evt-state-trap-{i}"), "conformance.trap", b"{}");
        c.process(p.as_ref(), &trap).await;
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM conformance_state").await,
        3
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM conformance_state WHERE calls = 1")
            .await,
        3,
        "{lang}: every delivery saw a fresh instance"
    );
    env.cleanup().await;
}

/// Every language's components import nothing beyond what idemhost grants; the closing
/// table in docs/benchmark.md (the languages) lists what each gets.
async fn component_imports_only_granted_interfaces(lang: &str) {
    let builds = [
        (inventory_name(lang), "0.2.0"),
        (template_name(lang), "0.2.0"),
        (conformance_name(lang, Wit::V0_2), "0.2.0"),
        (fixture_name(lang), "0.1.0"),
    ];
    for (name, version) in builds {
        let info = plugin(&name).load_info().clone();
        let filesystem_or_sockets = info
            .wasi_imports
            .iter()
            .any(|i| i.contains("filesystem") || i.contains("sockets") || i.contains("http"));
        assert!(!filesystem_or_sockets, "{name}: {:?}", info.wasi_imports);
        assert_eq!(info.world, format!("idemhost:consumer@{version}"), "{name}");
        println!(
            "{name}: {} bytes, wasi imports: {:?}",
            info.size, info.wasi_imports
        );
    }
}

/// A unique violation reaches a 0.2.0 plugin as a typed error (its kind, SQLSTATE and
/// constraint), which the conformance handler turns into a terminal failure: dead-lettered, not
/// redelivered, nothing committed.
async fn a_unique_violation_arrives_typed_and_the_plugin_makes_it_terminal(lang: &str) {
    let env = template_env("unique", lang).await;
    let (p, c) = (plugin(&conformance_name(lang, Wit::V0_2)), claimer(&env));
    let outcome = c
        .process(
            p.as_ref(),
            &event("evt-unique", "conformance.unique", b"{}"),
        )
        .await
        .outcome;
    assert_eq!(
        outcome,
        Outcome::TerminalFailure("duplicate: 23505 conformance_unique_pkey".into()),
        "{lang}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM conformance_unique").await,
        0
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    env.cleanup().await;
}

/// The template reads `max_note_bytes` from the consumer's `[consumer.config]`: a note longer
/// than the configured limit is terminal, one within it applies; without the key the
/// template's default (10,000 bytes) holds.
async fn the_template_reads_its_limit_from_the_consumer_config(lang: &str) {
    let env = template_env("config", lang).await;
    let limits = PluginLimits {
        timeout: HANDLER_TIMEOUT,
        memory: 64 << 20,
    };
    let load = || {
        runtime()
            .load(&plugin_path(&template_name(lang)), limits)
            .unwrap()
    };
    let config = [("max_note_bytes".to_string(), "5".to_string())];
    let limited = load().with_config(Arc::new(config.into_iter().collect()));
    let c = claimer(&env);
    let long = event(
        "evt-long",
        "NoteAdded",
        br#"{"noteId":"n-1","text":"longer than five"}"#,
    );
    assert_terminal(
        &c.process(&limited, &long).await.outcome,
        "a note's text must be 1 to 5 bytes",
    );
    let short = event(
        "evt-short",
        "NoteAdded",
        br#"{"noteId":"n-2","text":"short"}"#,
    );
    assert_eq!(c.process(&limited, &short).await.outcome, Outcome::Applied);
    // The same component without the key: its default.
    assert_eq!(c.process(&load(), &long).await.outcome, Outcome::Applied);
    assert_eq!(env.scalar("SELECT count(*) FROM note").await, 2);
    env.cleanup().await;
}
