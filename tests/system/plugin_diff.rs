//! `idemhost plugin diff`, through the binary: a candidate version run beside the deployed one
//! on the stream's last messages, each in a rolled-back transaction, against a real stream and
//! schema; the consumer's durable and the database are left as they were.

use std::process::Command;
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idemhost");

/// A candidate that behaves the same shows no difference (exit 0; the deployed bytes
/// themselves are not even run); a version that writes another value
/// shows it in each message's statement (exit 7), for the last N messages only, a message
/// already applied (its marker committed) included; the durable's position, the markers and
/// the effects are unchanged afterwards.
#[tokio::test]
async fn plugin_diff_shows_a_planted_change_and_nothing_for_an_identical_candidate() {
    let env = TestEnv::new("plugin_diff").await;
    let nats = NatsEnv::new("plugin_diff", Duration::from_secs(60)).await;
    env.execute(
        "CREATE TABLE swap_effect (message_id text PRIMARY KEY, handled_by text NOT NULL, attempt int NOT NULL)",
    )
    .await;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("plugin-diff"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("host.toml");
    std::fs::write(
        &config,
        config_text(&env, &nats, "diffed", "versioned-a", ""),
    )
    .unwrap();
    for i in 0..6 {
        nats.publish(Some(&format!("m-{i}")), "{}").await;
    }
    // The consumer's durable, as a host makes it; one message already applied.
    let stream = nats.js.get_stream(&nats.stream).await.unwrap();
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("diffed".into()),
            filter_subject: nats.subject(),
            ..Default::default()
        })
        .await
        .unwrap();
    let payload = dir.join("m.json");
    std::fs::write(&payload, "{}").unwrap();
    let applied = Command::new(BIN)
        .args(["plugin", "test"])
        .arg(plugin_path("versioned-a"))
        .arg("--config")
        .arg(&config)
        .arg("--payload")
        .arg(&payload)
        .args(["--id", "m-5", "--commit"])
        .output()
        .unwrap();
    assert_eq!(applied.status.code(), Some(0), "{applied:?}");
    let before = nats.consumer_info("diffed").await;
    assert_eq!((env.markers("diffed").await, effects(&env).await), (1, 1));

    // The deployed component with a custom section added: other bytes, the same behaviour.
    let same = dir.join("same.wasm");
    let mut bytes = std::fs::read(plugin_path("versioned-a")).unwrap();
    bytes.extend_from_slice(&[0x00, 0x03, 0x01, b'x', b'y']);
    std::fs::write(&same, bytes).unwrap();
    let diff = |candidate: &std::path::Path, json: bool| {
        let mut command = Command::new(BIN);
        command
            .args(["plugin", "diff"])
            .arg(candidate)
            .arg("--config")
            .arg(&config)
            .args(["--last", "3"]);
        if json {
            command.arg("--json");
        }
        command.output().unwrap()
    };
    let out = diff(&same, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("0 of 3 messages ran differently"), "{text}");
    assert_eq!(text.matches(": same (applied)").count(), 3, "{text}");

    // The deployed component itself: nothing to run.
    let copy = dir.join("copy.wasm");
    std::fs::copy(plugin_path("versioned-a"), &copy).unwrap();
    let out = diff(&copy, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("the candidate is the deployed version"),
        "{text}"
    );

    let out = diff(&plugin_path("versioned-b"), true);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["differ"], 3, "{report:#}");
    let messages = report["messages"].as_array().unwrap();
    let ids: Vec<&str> = messages.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["m-3", "m-4", "m-5"], "{report:#}");
    for m in messages {
        assert_eq!(m["same"], false);
        let (old, new) = (&m["deployed"], &m["candidate"]);
        assert_eq!(
            (old[0].as_str(), new[0].as_str()),
            (Some("applied"), Some("applied"))
        );
        let (old, new) = (old[1].as_str().unwrap(), new[1].as_str().unwrap());
        assert!(
            old.contains("\"a\"") && new.contains("\"b\"") && old.contains("1 rows affected"),
            "{old} / {new}"
        );
    }

    // Values are compared in full, not as shown: two runs whose one value differs only past
    // the part a line shows differ (they were reported the same).
    let testkit = plugin_path("testkit");
    let mut bytes = std::fs::read(&testkit).unwrap();
    bytes.extend_from_slice(&[0x00, 0x03, 0x01, b'x', b'y']);
    let candidate = dir.join("testkit-again.wasm");
    std::fs::write(&candidate, bytes).unwrap();
    nats.publish(
        Some("m-late"),
        r#"{"steps": [{"query": "SELECT repeat('x', 100) || clock_timestamp()::text"}]}"#,
    )
    .await;
    let out = Command::new(BIN)
        .args(["plugin", "diff"])
        .arg(&candidate)
        .arg("--config")
        .arg(&config)
        .args(["--last", "1", "--deployed"])
        .arg(&testkit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{text}");
    assert!(text.contains("1 of 1 message ran differently"), "{text}");

    // Nothing moved: the durable has the same position, nothing was committed.
    let after = nats.consumer_info("diffed").await;
    assert_eq!(
        (after.delivered.stream_sequence, after.num_ack_pending),
        (before.delivered.stream_sequence, before.num_ack_pending)
    );
    // The one message published since, and nothing else, is pending.
    assert_eq!(after.num_pending, before.num_pending + 1);
    assert_eq!(after.num_pending, 7);
    assert_eq!((env.markers("diffed").await, effects(&env).await), (1, 1));
    nats.cleanup().await;
    env.cleanup().await;
}

async fn effects(env: &TestEnv) -> i64 {
    env.scalar("SELECT count(*) FROM swap_effect").await
}
