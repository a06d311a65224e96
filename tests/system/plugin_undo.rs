//! `plugin test` taking back its set-up (migrations of a schema that had none, a role it made)
//! must never take back what someone else started using meanwhile, nor hang on them. Found by
//! review: the undo worked from a snapshot taken before the run, nothing locked in between, and
//! it dropped with CASCADE: a host that started on the schema during a rehearsal (the plugin
//! makes the window as long as its `handler_timeout`) lost its tables and markers, a
//! `plugin test --commit` meanwhile lost its marker (the same id then applied twice), and a
//! session of the new role hung the undo in `DROP OWNED BY`. Now the rehearsal holds the hosts'
//! migrations lock from before its migrations to the end of the undo, keeps host tables holding
//! rows and roles with sessions, drops without CASCADE under a lock timeout, and reports what it
//! kept.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemhost::Host;
use serde_json::Value;
use sqlx::Connection as _;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_idemhost");

/// A `plugin test` config for consumer `name` (testkit) on `env`'s schema; NATS is never
/// contacted (closed port).
fn rehearsal_config(env: &TestEnv, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("plugin_undo"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rehearsal.toml");
    std::fs::write(
        &path,
        format!(
            "[nats]\nurl = \"nats://127.0.0.1:1\"\n{}\n[[consumer]]\nname = \"{name}\"\n\
             stream = \"UNUSED\"\nsubjects = [\"demo.orders.placed\"]\nplugin = \"{}\"\n\
             tables = [\"inventory\"]\nhandler_timeout = \"40s\"\n",
            env.postgres_toml(),
            plugin_path("testkit").display()
        ),
    )
    .unwrap();
    path
}

/// Starts `idemhost plugin test testkit.wasm --config CONFIG --payload - --json ARGS…`.
fn spawn_plugin_test(config: &Path, payload: &str, args: &[&str]) -> Child {
    let mut child = Command::new(BIN)
        .args(["plugin", "test"])
        .arg(plugin_path("testkit"))
        .arg("--config")
        .arg(config)
        .args(["--payload", "-", "--json"])
        .args(args)
        .env_remove("IDEMHOST_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(payload.as_bytes())
        .unwrap();
    child
}

/// Waits (up to `timeout`) for a `plugin test` to end: its exit status, report and stderr.
async fn finish(mut child: Child, timeout: Duration) -> (Option<i32>, Value, String) {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("`plugin test` still running after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = child.wait_with_output().unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code(),
        report,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn exists(env: &TestEnv, relation: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("{}.{relation}", env.schema))
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

/// Waits until `role`'s session is sleeping in the rehearsal's delivery (the set-up is done,
/// the undo is `seconds` away).
async fn wait_rehearsal_sleeping(env: &TestEnv, role: &str, seconds: u32) {
    let like = format!("%pg_sleep({seconds})%");
    wait_until(
        Duration::from_secs(60),
        "the rehearsal's delivery to be running",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE usename = $1 AND query LIKE $2)",
            )
            .bind(role)
            .bind(&like)
            .fetch_one(&env.pool)
            .await
            .unwrap()
            .then_some(())
        },
    )
    .await;
}

fn bystander_script(tag: &str) -> String {
    serde_json::json!({"steps": [
        {"execute": format!("UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-b' /* {tag} */")},
    ]})
    .to_string()
}

/// A host started on the schema while a rolled-back `plugin test` (whose plugin sleeps in its
/// delivery) has migrated it: the host waits for the rehearsal's undo, then migrates for
/// itself; its consumer — the bystander — commits its markers, and the markers, the tables and
/// the functions are there; its messages keep applying once, duplicates included.
#[tokio::test]
async fn plugin_test_does_not_take_back_tables_a_host_started_using() {
    let env = TestEnv::without_migrations("undo_race").await;
    env.seed_inventory(&[("sku-b", 1000)]).await;
    let nats = NatsEnv::new("undo_race", Duration::from_millis(100)).await;

    // The rehearsal: looks (no migrations), migrates, provisions, and sleeps 25 s in its
    // delivery — the window a hostile plugin chooses, up to handler_timeout.
    let rehearsal_cfg = rehearsal_config(&env, "rehearsed-v1");
    let rehearsal = spawn_plugin_test(
        &rehearsal_cfg,
        r#"{"steps": [{"query": "SELECT pg_sleep(8)"}]}"#,
        &[],
    );
    wait_rehearsal_sleeping(&env, &env.plugin_role("rehearsed-v1"), 8).await;
    assert!(exists(&env, "processed_message").await);

    // A deploy of the real host lands now, on the same schema.
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        "bystander-v1",
        "testkit",
        "tables = [\"inventory\"]\nhandler_timeout = \"10s\"",
    )));
    let ids: Vec<String> = (0..5).map(|i| format!("by-{i}-{}", unique("m"))).collect();
    for id in &ids {
        nats.publish(Some(id), &bystander_script(id)).await;
    }
    wait_until(
        Duration::from_secs(90),
        "the bystander's first messages to apply",
        || async { (env.reserved("sku-b").await == 5).then_some(()) },
    )
    .await;
    let (code, report, stderr) = finish(rehearsal, Duration::from_secs(120)).await;
    eprintln!("plugin test exit {code:?}; report {report}; stderr {stderr}");

    // What the host committed is still there.
    assert!(
        exists(&env, "processed_message").await && exists(&env, "outbox_message").await,
        "`plugin test` dropped the host tables of a host that was running on the schema \
         (set-up removed: {})",
        report["setup_removed"]
    );
    assert_eq!(
        env.markers("bystander-v1").await,
        5,
        "the running host's markers were lost"
    );

    // The same ids again (past the broker's duplicate window): duplicates, no second effect.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in &ids {
        nats.publish(Some(id), &bystander_script(id)).await;
    }
    // And new ones apply, in time.
    for i in 5..10 {
        let id = format!("by-{i}-{}", unique("m"));
        nats.publish(Some(&id), &bystander_script(&id)).await;
    }
    wait_until(
        Duration::from_secs(30),
        "the bystander's later messages to apply",
        || async { (env.reserved("sku-b").await == 10).then_some(()) },
    )
    .await;
    nats.wait_drained("bystander-v1", Duration::from_secs(30))
        .await;
    assert_eq!(env.reserved("sku-b").await, 10, "a duplicate applied twice");
    assert!(
        nats.dead_letters().await.is_empty(),
        "the bystander's messages were dead-lettered"
    );

    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A `plugin test --commit` that runs while a rolled-back `plugin test` of a fresh schema is in
/// its delivery commits a marker and an effect; the rolled-back one's undo must not drop that
/// marker: the same message id, committed again, is a duplicate (exit 3), and the effect is
/// applied once. Before the fix the second commit applied (exit 0) and `reserved` was 2.
#[tokio::test]
async fn a_rolled_back_plugin_test_does_not_erase_a_committed_one() {
    let env = TestEnv::without_migrations("undo_commit").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let cfg = rehearsal_config(&env, "reservation-v1");
    let role = env.plugin_role("reservation-v1");

    // A: rolled back, slow (the plugin sleeps in its delivery).
    let slow = spawn_plugin_test(&cfg, r#"{"steps": [{"query": "SELECT pg_sleep(8)"}]}"#, &[]);
    wait_rehearsal_sleeping(&env, &role, 8).await;

    // B: the operator seeds one message for real, meanwhile.
    let reserve = r#"{"steps": [{"execute": "UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    let (code_b, report_b, stderr_b) = finish(
        spawn_plugin_test(&cfg, reserve, &["--commit", "--id", "order-42"]),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(code_b, Some(0), "{report_b:#}\n{stderr_b}");
    assert_eq!(env.reserved("sku-1").await, 1);
    assert_eq!(env.markers("reservation-v1").await, 1);

    let (code_a, report_a, stderr_a) = finish(slow, Duration::from_secs(90)).await;
    eprintln!("rolled-back run: exit {code_a:?}; {report_a}; {stderr_a}");

    // The committed marker survived A's undo…
    assert!(
        exists(&env, "processed_message").await,
        "the rolled-back run dropped the host tables a committed run wrote to (set-up removed: {})",
        report_a["setup_removed"]
    );
    assert_eq!(
        env.markers("reservation-v1").await,
        1,
        "the committed marker was erased"
    );

    // …so the same id committed again is a duplicate, not a second reservation.
    let (code_c, report_c, stderr_c) = finish(
        spawn_plugin_test(&cfg, reserve, &["--commit", "--id", "order-42"]),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        (code_c, env.reserved("sku-1").await),
        (Some(3), 1),
        "message order-42 applied twice: {report_c:#}\n{stderr_c}"
    );

    env.cleanup().await;
}

async fn bystander_applies(env: &TestEnv, nats: &NatsEnv, n: i64, within: Duration) -> bool {
    let before = env.reserved("sku-b").await;
    for i in 0..n {
        let id = format!("by-{i}-{}", unique("m"));
        nats.publish(Some(&id), &bystander_script(&id)).await;
    }
    let start = Instant::now();
    while start.elapsed() < within {
        if env.reserved("sku-b").await == before + n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A session of the role a rolled-back rehearsal made (a temporary table in an open
/// transaction) neither hangs the rehearsal's undo nor a host restarted meanwhile: the role is
/// kept, and said so.
#[tokio::test]
async fn a_session_of_the_rehearsals_role_cannot_hang_the_undo_or_a_hosts_start() {
    let env = TestEnv::new("undo_hang").await;
    env.seed_inventory(&[("sku-b", 1000)]).await;
    let nats = NatsEnv::new("undo_hang", Duration::from_millis(100)).await;
    let bystander_config = || {
        config(
            &env,
            &nats,
            "bystander-v1",
            "testkit",
            "tables = [\"inventory\"]\nhandler_timeout = \"10s\"",
        )
    };
    let host = RunningHost::start(Host::new(bystander_config()));
    assert!(
        bystander_applies(&env, &nats, 3, Duration::from_secs(90)).await,
        "the bystander did not start"
    );

    // The operator rehearses a new consumer on the same schema.
    let cfg = rehearsal_config(&env, "newcomer-v1");
    let mut rehearsal =
        spawn_plugin_test(&cfg, r#"{"steps": [{"query": "SELECT pg_sleep(5)"}]}"#, &[]);
    let started = Instant::now();
    let role = env.plugin_role("newcomer-v1");
    wait_until(Duration::from_secs(60), "the rehearsal's delivery", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE usename = $1 AND query LIKE '%pg_sleep(5)%')",
        )
        .bind(&role)
        .fetch_one(&env.pool)
        .await
        .unwrap()
        .then_some(())
    })
    .await;

    // A session of the new role: a temporary table, locked in an open transaction.
    let mut squatter = sqlx::PgConnection::connect(&pg_url_as(&role))
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN; CREATE TEMP TABLE squat (x int); INSERT INTO squat VALUES (1)")
        .execute(&mut squatter)
        .await
        .unwrap();

    // The rehearsal's delivery ends; its undo either finishes or waits on the squatter's lock.
    let undo_waits = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query ILIKE 'DROP OWNED BY%')",
        )
        .fetch_one(&env.pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        if rehearsal.try_wait().unwrap().is_some() || undo_waits().await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A deploy restarts the bystander's host now: its provisioning GRANTs on the schema, the
    // host's functions and `inventory`.
    host.stop().await;
    let restarted = RunningHost::start(Host::new(bystander_config()));
    let bystander_in_time = bystander_applies(&env, &nats, 3, Duration::from_secs(30)).await;

    // `plugin test` ends within a bound (the delivery was 5 s; allow a minute for everything).
    let mut ended = None;
    while started.elapsed() < Duration::from_secs(60) {
        if let Some(status) = rehearsal.try_wait().unwrap() {
            ended = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let hung_on_lock = undo_waits().await;

    // Release everything before asserting, so the cleanup can run.
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut squatter).await;
    let _ = squatter.close().await;
    let out = rehearsal.wait_with_output().unwrap();
    eprintln!(
        "plugin test: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    assert!(
        ended.is_some(),
        "`plugin test` did not end within 60 s (undo waiting on a lock: {hung_on_lock}): a \
         session of the rehearsal's role held it in DROP OWNED BY"
    );
    assert!(
        bystander_in_time,
        "the bystander's host, restarted while `plugin test` was taking back its set-up, did not \
         apply its messages within 30 s"
    );
    restarted.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
