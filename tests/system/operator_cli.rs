//! The operator's commands, run as the binary against a host consuming the real NATS and
//! PostgreSQL: `check` proves marker and effect (and catches a marker without its effect),
//! `markers prune` keeps the replay-horizon contract, `dlq replay` republishes under the
//! original id so the marker decides.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// Runs `idemhost ARGS`; (exit code, stdout, stderr).
fn idemhost(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Runs `idemhost COMMAND --config CONFIG --consumer CONSUMER EXTRA`.
fn op(command: &[&str], config: &str, consumer: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = command.to_vec();
    args.extend_from_slice(&["--config", config, "--consumer", consumer]);
    args.extend_from_slice(extra);
    idemhost(&args)
}

fn write_config(tag: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(tag));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idemhost.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn insert_effect(table: &str, id: &str) -> String {
    format!(
        r#"{{"steps":[{{"execute":"INSERT INTO {table} (message_id) VALUES ($1)","params":["{id}"]}}]}}"#
    )
}

fn digest_of_testkit() -> String {
    let limits = idemhost::PluginLimits {
        timeout: Duration::from_secs(5),
        memory: 64 << 20,
    };
    runtime()
        .load(&plugin_path("testkit"), limits)
        .unwrap()
        .digest()
        .to_string()
}

/// `check` finds marker (with its plugin version) and effect; deleting the effect by hand
/// makes it exit 2 with the invariant warning; an unknown id exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_proves_marker_and_effect() {
    const NAME: &str = "check-v1";
    let env = TestEnv::new("check").await;
    let nats = NatsEnv::new("check", Duration::from_secs(60)).await;
    env.execute("CREATE TABLE ops_effect (message_id text NOT NULL)")
        .await;
    let text = config_text(
        &env,
        &nats,
        NAME,
        "testkit",
        "effect_query = \"SELECT message_id FROM ops_effect WHERE message_id = $1\"",
    );
    let path = write_config("check", &text);
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    nats.publish(Some("c-1"), &insert_effect("ops_effect", "c-1"))
        .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    let config = path.to_str().unwrap();

    let (code, out, err) = op(&["check"], config, NAME, &["--message-id", "c-1"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("marker:     yes"), "{out}");
    assert!(
        out.contains(&digest_of_testkit()),
        "the plugin version: {out}"
    );
    assert!(out.contains("effect:     1 row(s)"), "{out}");

    let (code, out, _) = op(&["check"], config, NAME, &["--message-id", "c-1", "--json"]);
    assert_eq!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["verdict"], "applied");
    assert_eq!(report["effect"]["sample"][0]["message_id"], "c-1");

    // A hand edit removes the effect but not the marker.
    env.execute("DELETE FROM ops_effect WHERE message_id = 'c-1'")
        .await;
    let (code, out, err) = op(&["check"], config, NAME, &["--message-id", "c-1"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("INVARIANT VIOLATED"), "{err}");
    assert!(out.contains("effect:     0 row(s)"), "{out}");

    let (code, out, err) = op(&["check"], config, NAME, &["--message-id", "never-sent"]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("marker:     none"), "{out}");
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

async fn markers_older_than(env: &TestEnv, consumer: &str, age: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM processed_message WHERE consumer_name = $1 \
         AND processed_at < now() - $2::interval",
    )
    .bind(consumer)
    .bind(age)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

fn prune(config: &Path, consumer: &str, extra: &[&str]) -> (i32, String, String) {
    op(
        &["markers", "prune"],
        config.to_str().unwrap(),
        consumer,
        extra,
    )
}

/// With a 1 s `replay_horizon` and 3 s later, `markers prune --older-than 2s` is refused for
/// the message the stream still holds; the consumer's configuration file.
async fn prune_refused_for_the_stream(env: &TestEnv, nats: &NatsEnv, name: &str) -> PathBuf {
    let short = config_text(env, nats, name, "testkit", "replay_horizon = \"1s\"");
    let config = write_config("prune", &short);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (code, _, err) = prune(&config, name, &["--older-than", "2s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("stream {} still holds a message", nats.stream)),
        "{err}"
    );
    config
}

/// `markers prune` refuses inside the replay horizon, while the stream or the dead letters
/// still hold an older message, and inside the stream's max_age; outside all of them it
/// deletes in bounded batches (plugin-version rows go with their markers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_the_replay_horizon() {
    const NAME: &str = "prune-v1";
    let env = TestEnv::new("prune").await;
    let nats = NatsEnv::new("prune", Duration::from_secs(60)).await;
    let text = config_text(&env, &nats, NAME, "testkit", "max_deliver = 1");
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    nats.publish(Some("p-1"), r#"{"steps":[]}"#).await;
    nats.publish(Some("p-2"), r#"{"steps":[{"fail":"terminal"}]}"#)
        .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    host.stop().await;
    // 50 markers from 100 days ago, whose messages have long left the stream; two of them
    // with a plugin-version row.
    sqlx::query(
        "INSERT INTO processed_message (consumer_name, message_id, processed_at) \
         SELECT $1, 'old-' || i, now() - interval '100 days' FROM generate_series(1, 50) i",
    )
    .bind(NAME)
    .execute(&env.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_message_handler (consumer_name, message_id, plugin_digest) \
         VALUES ($1, 'old-1', 'sha256:x'), ($1, 'old-2', 'sha256:x')",
    )
    .bind(NAME)
    .execute(&env.pool)
    .await
    .unwrap();
    let config = write_config("prune", &text);

    // Inside the default 30-day replay horizon.
    let (code, _, err) = prune(&config, NAME, &["--older-than", "7d"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("replay_horizon is 30days"), "{err}");
    assert_eq!(env.markers(NAME).await, 51);

    let (code, out, err) = prune(&config, NAME, &["--older-than", "90d", "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("would delete 50 markers"), "{out}");
    assert_eq!(env.markers(NAME).await, 51);

    let (code, out, err) = prune(&config, NAME, &["--older-than", "90d", "--batch", "7"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("deleted 50 markers") && out.contains("in 8 batch(es)"),
        "{out}"
    );
    assert_eq!(env.markers(NAME).await, 1, "the recent marker stays");
    assert_eq!(markers_older_than(&env, NAME, "1 day").await, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message_handler WHERE message_id LIKE 'old-%'")
            .await,
        0
    );

    // A consumer whose horizon allows pruning after seconds: now the messages themselves, still
    // in the stream and in the dead letters, are what protects their markers.
    let config = prune_refused_for_the_stream(&env, &nats, NAME).await;

    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    stream.purge().filter(nats.subject()).await.unwrap();
    let (code, _, err) = prune(&config, NAME, &["--older-than", "2s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("dead letters on {}", nats.dlq())),
        "{err}"
    );

    stream.purge().filter(nats.dlq()).await.unwrap();
    let mut stream_config = stream.cached_info().config.clone();
    stream_config.max_age = Duration::from_secs(3600);
    nats.js.update_stream(stream_config).await.unwrap();
    let (code, _, err) = prune(&config, NAME, &["--older-than", "2s"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("keeps messages for 1h (max_age)"), "{err}");

    let (code, out, err) = prune(&config, NAME, &["--older-than", "2h"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("deleted 0 markers"), "{out}");
    let mut stream_config = stream.cached_info().config.clone();
    stream_config.max_age = Duration::ZERO;
    nats.js.update_stream(stream_config).await.unwrap();
    let (code, out, err) = prune(&config, NAME, &["--older-than", "2s"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("deleted 1 markers"), "{out}");
    assert_eq!(env.markers(NAME).await, 0);
    nats.cleanup().await;
    env.cleanup().await;
}

/// A producer's message the NATS client cannot read (a header block that is not UTF-8), first
/// in the consumer's stream and on its dead-letter subject, stops neither `markers prune`'s
/// horizon check (it still refuses for the message, by its age) nor `dlq list` (nor the
/// consumer samplers' oldest unacknowledged message, which `markers prune`'s lookup serves
/// too). Before, each read the message through the client's getter, which parses the header
/// block: "invalid header", for as long as the stream held the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_client_cannot_read_stops_no_operator_command() {
    const NAME: &str = "unreadable-ops-v1";
    let env = TestEnv::new("unreadable_ops").await;
    let nats = NatsEnv::new("unreadable_ops", Duration::from_secs(60)).await;
    let server = NATS_URL.trim_start_matches("nats://");
    let bad: &[u8] = b"Nats-Msg-Id: unreadable-ops\r\nX-Blob: \xff\xfe\x80\r\n";
    publish_raw(server, &nats.subject(), bad, b"{}").await;
    publish_raw(server, &nats.dlq(), bad, b"{}").await;
    hand_dead_letter(&nats, NAME, "m-1", "{}", "t").await;
    let config = prune_refused_for_the_stream(&env, &nats, NAME).await;
    let (code, out, err) = op(&["dlq", "list"], config.to_str().unwrap(), NAME, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("1 dead letter(s)") && out.contains("m-1"),
        "{out}"
    );

    nats.cleanup().await;
    env.cleanup().await;
}

/// Publishes a dead letter by hand, as the host writes it, for a message of `consumer`.
async fn hand_dead_letter(nats: &NatsEnv, consumer: &str, id: &str, payload: &str, tag: &str) {
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", format!("{consumer}/{id}/{tag}").as_str());
    h.insert("Idemhost-Message-Id", id);
    h.insert("Idemhost-Consumer", consumer);
    h.insert("Idemhost-Original-Subject", nats.subject().as_str());
    h.insert("Idemhost-Failure-Reason", "made by hand");
    h.insert("Idemhost-Delivery-Attempt", "1");
    h.insert("Idemhost-Event-Type", "OrderPlaced");
    nats.js
        .publish_with_headers(nats.dlq(), h, payload.to_string().into_bytes().into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// A producer cannot make a dead letter name another message: a message refused for its id
/// (300 bytes, over the limit) that carries `Idemhost-Message-Id: m-victim` and forged
/// dead-letter headers is dead-lettered with each of those headers in the host's word or
/// absent, so `idemhost dlq replay` skips it ("without a valid message id") instead of signing
/// a replay of the producer's payload under m-victim's id, which would claim its marker.
/// Before, the forged id (and SQLSTATE) stayed in the dead letter: the host wrote its own only
/// when it had them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_cannot_name_another_in_its_dead_letter() {
    use idemhost::headers::{
        DELIVERY_ATTEMPT_HEADER, FAILED_CONSUMER_HEADER, ORIGINAL_SUBJECT_HEADER, REPLAY_ID_HEADER,
    };
    const NAME: &str = "forgeid-v1";
    let env = TestEnv::new("forgeid").await;
    let nats = NatsEnv::new("forgeid", Duration::from_secs(60)).await;
    env.execute("CREATE TABLE ops_effect (message_id text NOT NULL)")
        .await;
    let text = config_text(&env, &nats, NAME, "testkit", "max_deliver = 1");
    let config = write_config("forgeid", &text);
    let config = config.to_str().unwrap();
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "x".repeat(300).as_str());
    for (name, value) in [
        (REPLAY_ID_HEADER, "m-victim"),
        ("idemhost-message-id", "m-victim"),
        ("Idemhost-Failure-Sqlstate", "00000"),
        (FAILED_CONSUMER_HEADER, "someone-else"),
        (DELIVERY_ATTEMPT_HEADER, "99"),
        (ORIGINAL_SUBJECT_HEADER, "elsewhere"),
    ] {
        headers.append(name, value);
    }
    nats.publish_many([(headers, insert_effect("ops_effect", "forged"))])
        .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let values = |name: &str| -> Vec<String> {
        letters[0]
            .0
            .iter()
            .filter(|(n, _)| AsRef::<str>::as_ref(*n).eq_ignore_ascii_case(name))
            .flat_map(|(_, vs)| vs.iter().map(|v| v.as_str().to_string()))
            .collect()
    };
    assert_eq!(values(REPLAY_ID_HEADER), Vec::<String>::new());
    assert_eq!(values("Idemhost-Failure-Sqlstate"), Vec::<String>::new());
    assert_eq!(values(FAILED_CONSUMER_HEADER), [NAME]);
    assert_eq!(values(DELIVERY_ATTEMPT_HEADER), ["1"]);
    assert_eq!(values(ORIGINAL_SUBJECT_HEADER), [nats.subject()]);

    let (code, out, err) = op(&["dlq", "replay"], config, NAME, &["--all"]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(out.contains("without a valid message id"), "{out}{err}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'm-victim'")
            .await,
        0
    );
    assert_eq!(env.scalar("SELECT count(*) FROM ops_effect").await, 0);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A message dead-lettered because its table was missing applies once when replayed after
/// the fix, under its original id; a replayed message that had applied is a duplicate; a repair
/// replay applies again under a new, audited id — once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_keeps_the_original_id() {
    const NAME: &str = "replay-v1";
    let env = TestEnv::new("replay").await;
    let nats = NatsEnv::new("replay", Duration::from_secs(60)).await;
    env.execute("CREATE TABLE ops_effect (message_id text NOT NULL)")
        .await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(&env, &nats, NAME, "testkit", "max_deliver = 1")
        + &format!("\n[admin]\nlisten = \"{admin}\"\n");
    let config = write_config("replay", &text);
    let config = config.to_str().unwrap();
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let late = insert_effect("ops_late", "m-1");
    nats.publish(Some("m-1"), &late).await;
    nats.publish(Some("m-2"), &insert_effect("ops_effect", "m-2"))
        .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;

    let (code, out, err) = op(&["dlq", "list"], config, NAME, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 dead letter(s)"), "{out}");
    let line = out.lines().find(|l| l.contains("m-1")).unwrap_or_default();
    assert!(line.contains("ops_late"), "the reason: {out}");

    // The fix: the missing table, granted to the plugin's role. The replay applies m-1 once, under its own id.
    env.execute(&format!(
        "CREATE TABLE ops_late (message_id text NOT NULL); GRANT INSERT ON ops_late TO {}",
        env.plugin_role(NAME)
    ))
    .await;
    let (code, out, err) = op(&["dlq", "replay"], config, NAME, &["--message-id", "m-1"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("as m-1 to"), "{out}");
    wait_until(Duration::from_secs(30), "m-1 to apply", || async {
        (env.scalar("SELECT count(*) FROM ops_late WHERE message_id = 'm-1'")
            .await
            == 1)
            .then_some(())
    })
    .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'm-1'")
            .await,
        1
    );
    let (_, out, _) = op(&["dlq", "list"], config, NAME, &[]);
    assert!(
        out.contains("0 dead letter(s)"),
        "replayed letters leave the DLQ: {out}"
    );

    // A dead letter of a message that had applied: the replay is a duplicate.
    hand_dead_letter(&nats, NAME, "m-2", &insert_effect("ops_effect", "m-2"), "a").await;
    let (code, out, err) = op(&["dlq", "replay"], config, NAME, &["--all"]);
    assert_eq!(code, 0, "{out}{err}");
    let metrics_url = format!("http://{admin}/metrics");
    let duplicate = format!(
        "idemhost_deliveries_total{{consumer=\"{NAME}\",event_type=\"OrderPlaced\",outcome=\"duplicate\"}} 1"
    );
    wait_until(
        Duration::from_secs(30),
        "the replay to count as a duplicate",
        || async {
            let text = idemhost::ops::admin::get(&metrics_url, Duration::from_secs(5))
                .await
                .ok()?;
            text.lines().any(|l| l == duplicate).then_some(())
        },
    )
    .await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM ops_effect WHERE message_id = 'm-2'")
            .await,
        1
    );

    // Reprocessing on purpose: a new id, recorded before it is published, usable once.
    hand_dead_letter(&nats, NAME, "m-2", &insert_effect("ops_effect", "m-2"), "b").await;
    let repair = [
        "--message-id",
        "m-2",
        "--repair-key",
        "m-2-repair-1",
        "--reason",
        "effect lost in a restore",
    ];
    let (code, out, err) = op(&["dlq", "replay"], config, NAME, &repair);
    assert_eq!(code, 0, "{out}{err}");
    wait_until(Duration::from_secs(30), "the repair to apply", || async {
        (env.scalar("SELECT count(*) FROM ops_effect WHERE message_id = 'm-2'")
            .await
            == 2)
            .then_some(())
    })
    .await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'm-2-repair-1'")
            .await,
        1
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM dead_letter_repair WHERE repair_key = 'm-2-repair-1' AND original_message_id = 'm-2' AND reason = 'effect lost in a restore'").await,
        1
    );
    hand_dead_letter(&nats, NAME, "m-2", &insert_effect("ops_effect", "m-2"), "c").await;
    let (code, _, err) = op(&["dlq", "replay"], config, NAME, &repair);
    assert_eq!(code, 1);
    assert!(
        err.contains("repair key m-2-repair-1 was already used"),
        "{err}"
    );
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM ops_effect WHERE message_id = 'm-2'")
            .await,
        2
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// `--log-format json`: the delivery's line carries consumer, message id, event type, the
/// trace id of its `traceparent`, attempt, outcome and durations — and never the payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_delivery_fields_not_the_payload() {
    const NAME: &str = "logs-v1";
    let env = TestEnv::new("logs").await;
    let nats = NatsEnv::new("logs", Duration::from_secs(60)).await;
    let text = config_text(&env, &nats, NAME, "testkit", "");
    let config = write_config("logs", &text);
    let child = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args([
            "--log-format",
            "json",
            "run",
            "--config",
            config.to_str().unwrap(),
        ])
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "logged-1");
    headers.insert("Idemhost-Event-Type", "OrderPlaced");
    headers.insert(
        "traceparent",
        format!("00-{trace_id}-b7ad6b7169203331-01").as_str(),
    );
    let payload = r#"{"steps":[],"secret":"do-not-log-me"}"#;
    nats.js
        .publish_with_headers(nats.subject(), headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), "the message to apply", || async {
        (env.markers(NAME).await == 1).then_some(())
    })
    .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("do-not-log-me"),
        "the payload leaked: {stderr}"
    );
    let done: serde_json::Value = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "delivery done")
        .unwrap_or_else(|| panic!("no `delivery done` line: {stderr}"));
    let first: serde_json::Value =
        serde_json::from_str(stderr.lines().next().unwrap_or("")).unwrap();
    assert_eq!(first["message"], "idemhost starting", "{stderr}");
    assert_eq!(first["version"], env!("CARGO_PKG_VERSION"), "{stderr}");
    let span = &done["span"];
    assert_eq!(span["name"], "idemhost.delivery", "{done}");
    assert_eq!(span["consumer"], NAME, "{done}");
    assert_eq!(span["message_id"], "logged-1", "{done}");
    assert_eq!(span["event_type"], "OrderPlaced", "{done}");
    assert_eq!(span["trace_id"], trace_id, "{done}");
    assert_eq!(span["attempt"], 1, "{done}");
    assert_eq!(span["outcome"], "applied", "{done}");
    assert!(span["tx_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{done}");
    assert!(
        span["plugin"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:")),
        "{done}"
    );
    nats.cleanup().await;
    env.cleanup().await;
}

/// Text logs to something that is not a terminal (a file, a pipe, a collector) carry no ANSI
/// colour codes (they did), the first line says which version starts, and the default filter
/// keeps the server's notices to the host's sessions out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_to_a_pipe_are_plain_and_name_the_version() {
    use std::io::BufRead as _;
    const NAME: &str = "plain-v1";
    let env = TestEnv::new("plain_logs").await;
    let nats = NatsEnv::new("plain_logs", Duration::from_secs(60)).await;
    let text = config_text(&env, &nats, NAME, "testkit", "");
    let config = write_config("plain_logs", &text);
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args([
            "--log-format",
            "text",
            "run",
            "--config",
            config.to_str().unwrap(),
        ])
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("idemhost running") {
                let _ = tx.send(());
            }
            lines.push(line);
        }
        lines
    });
    let running = rx.recv_timeout(Duration::from_secs(60)).is_ok();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let lines = reader.join().unwrap();
    let all = lines.join("\n");
    assert!(running, "never running: {all}");
    assert!(status.success(), "{status}: {all}");
    assert!(
        !all.contains('\u{1b}'),
        "ANSI codes in a piped log: {all:?}"
    );
    // The schema was migrated before (TestEnv): the migrations' "already exists, skipping"
    // notice was an INFO line of every start.
    assert!(!all.contains("sqlx::postgres::notice"), "{all}");
    let version = env!("CARGO_PKG_VERSION");
    let named = [
        format!("version=\"{version}\""),
        format!("version={version}"),
    ];
    assert!(
        lines[0].contains("idemhost starting") && named.iter().any(|v| lines[0].contains(v)),
        "{all}"
    );
    nats.cleanup().await;
    env.cleanup().await;
}

/// A consumer whose plugin file is missing is refused before anything connects: the schema is
/// not created or migrated, no stream is made. Before, the file was read only after the
/// migrations ran and NATS connected.
#[tokio::test]
async fn a_missing_plugin_file_is_refused_before_the_servers_are_touched() {
    let schema = format!("t_{}", unique("no_plugin"));
    let stream = format!("NOPLUGIN_{}", unique("s").to_uppercase());
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{PG_URL}\"\nschema = \"{schema}\"\n\
         [[consumer]]\nname = \"absent-v1\"\nstream = \"{stream}\"\nsubjects = [\"{}.x\"]\n\
         create_stream = true\nplugin = \"/nonexistent/absent.wasm\"\n",
        stream.to_lowercase()
    );
    let error = start_error(parse_config(&text)).await;
    assert!(
        error.contains("absent-v1") && error.contains("/nonexistent/absent.wasm"),
        "{error}"
    );
    let pool = schema_pool(&PG_URL, "public", 1).await;
    let created: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(&schema)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!created, "the schema was created before the refusal");
    let js = async_nats::jetstream::new(async_nats::connect(NATS_URL.get()).await.unwrap());
    assert!(js.get_stream(&stream).await.is_err(), "the stream was made");
}

/// `--no-migrate` against a schema that lacks some of the host's migrations is refused at
/// start, naming them and what to run; before, the host ran and failed later, per delivery, on
/// a function or column that was not there. Nothing is applied and no stream is made.
#[tokio::test]
async fn no_migrate_refuses_a_schema_behind_the_binary() {
    let env = TestEnv::new("behind").await;
    env.execute("DELETE FROM _sqlx_migrations WHERE version >= 12")
        .await;
    let stream = format!("BEHIND_{}", unique("s").to_uppercase());
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}\n[[consumer]]\nname = \"behind-v1\"\nstream = \"{stream}\"\n\
         subjects = [\"{}.x\"]\ncreate_stream = true\nplugin = \"{}\"\n",
        env.postgres_toml(),
        stream.to_lowercase(),
        plugin_path("testkit").display()
    );
    let run = idemhost::Host::new(parse_config(&text)).run(
        idemhost::RunOptions { migrate: false },
        std::future::pending::<()>(),
    );
    let error = match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(Err(e)) => format!("{e:#}"),
        other => panic!("the host started: {other:?}"),
    };
    assert!(
        error.contains("0012 clear checks the claim")
            && error.contains("0013 key check without a read")
            && error.contains("idemhost migrate"),
        "{error}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM _sqlx_migrations WHERE version >= 12")
            .await,
        0
    );
    let js = async_nats::jetstream::new(async_nats::connect(NATS_URL.get()).await.unwrap());
    assert!(js.get_stream(&stream).await.is_err(), "the stream was made");
    env.cleanup().await;
}

/// A table in `tables` that does not exist is reported as that, before anything is created:
/// it was "the plugin's role is not ready", followed by the fourteen statements that create
/// and grant a role (`plugin test` printed them too). No role is left behind.
#[tokio::test]
async fn a_missing_table_is_named_not_blamed_on_the_role() {
    let env = TestEnv::new("no_table").await;
    let nats = NatsEnv::new("no_table", Duration::from_secs(1)).await;
    let consumer = "missing-table-v1";
    let config = config(
        &env,
        &nats,
        consumer,
        "testkit",
        "tables = [\"inventory\", \"no_such_table\"]",
    );
    let error = start_error(config).await;
    assert!(
        error.contains("names a table that does not exist")
            && error.contains("\"no_such_table\"")
            && !error.contains("CREATE ROLE")
            && !error.contains("not ready"),
        "{error}"
    );
    let role = env.plugin_role(consumer);
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM pg_roles WHERE rolname = '{role}'"
        ))
        .await,
        0,
        "the role was created before the refusal"
    );
    nats.cleanup().await;
    env.cleanup().await;
}

/// A start refused for one consumer changes nothing for any: with a good first consumer (its
/// stream to be created) and a second whose table is missing, or whose stream is missing, the
/// schema is not migrated, no role is made and no stream is created. Before, the schema was
/// migrated and the first consumer's role, stream and durable made before the second was
/// looked at.
#[tokio::test]
async fn a_start_refused_for_one_consumer_changes_nothing_for_any() {
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&PG_URL)
        .await
        .unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(NATS_URL.get()).await.unwrap());
    for (case, second) in [
        (
            "missing table",
            "create_stream = true\ntables = [\"no_such_table\"]",
        ),
        (
            "missing stream",
            "create_stream = false\ntables = [\"inventory\"]",
        ),
    ] {
        let schema = format!("t_{}", unique("refused_all"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {schema}.inventory (sku text)"
        )))
        .execute(&admin)
        .await
        .unwrap();
        let good = format!("GOOD_{}", unique("s").to_uppercase());
        let bad = format!("BAD_{}", unique("s").to_uppercase());
        let text = format!(
            "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{PG_URL}\"\nschema = \"{schema}\"\n\
             [[consumer]]\nname = \"good-v1\"\nstream = \"{good}\"\nsubjects = [\"{}.x\"]\n\
             create_stream = true\nplugin = \"{plugin}\"\ntables = [\"inventory\"]\n\
             [[consumer]]\nname = \"second-v1\"\nstream = \"{bad}\"\nsubjects = [\"{}.x\"]\n\
             plugin = \"{plugin}\"\n{second}\n",
            good.to_lowercase(),
            bad.to_lowercase(),
            plugin = plugin_path("testkit").display(),
        );
        let config = parse_config(&text);
        let roles: Vec<String> = config
            .consumers
            .iter()
            .map(|c| idemhost::test_support::pg::wall::plugin_role(&config.postgres, c))
            .collect();
        let error = start_error(config).await;
        assert!(error.contains("second-v1"), "{case}: {error}");
        let count = server_scalar;
        assert_eq!(
            count(format!(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = '{schema}' AND c.relkind = 'r'"
            ))
            .await,
            1,
            "{case}: the schema was migrated"
        );
        for role in &roles {
            assert_eq!(
                count(format!(
                    "SELECT count(*) FROM pg_roles WHERE rolname = '{role}'"
                ))
                .await,
                0,
                "{case}: role {role} was made"
            );
        }
        for stream in [&good, &bad] {
            assert!(
                js.get_stream(stream).await.is_err(),
                "{case}: stream {stream} was made"
            );
        }
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await
            .unwrap();
    }
}
