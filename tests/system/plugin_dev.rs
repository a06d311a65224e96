//! A plugin author's loop, through the binary: `idemhost plugin test` runs one message through
//! a component as a delivery would and leaves nothing behind (checked by SQL; the broker is
//! never contacted: the configs point NATS at a closed port); `idemhost plugin new` makes a
//! project in each language that `idemhost plugin build` builds and `plugin test` applies.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idemhost");

/// A scratch directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique(tag));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A config for consumer `name` running `plugin` on `env`'s schema; NATS at a port where
/// nothing listens, so a command that touched the broker would fail.
fn write_config(dir: &Path, env: &TestEnv, name: &str, plugin: &Path, extra: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[nats]\nurl = \"nats://127.0.0.1:1\"\n{}\n[[consumer]]\nname = \"{name}\"\nstream = \"UNUSED\"\n\
         subjects = [\"demo.orders.placed\"]\nplugin = \"{}\"\n{extra}\n",
        env.postgres_toml(),
        plugin.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `idemhost plugin test FILE --config CONFIG --json ARGS…` with `payload` on stdin: the exit
/// status and the report.
fn plugin_test(file: &Path, config: &Path, payload: &str, args: &[&str]) -> (i32, Value) {
    use std::io::Write as _;
    let mut child = Command::new(BIN)
        .args(["plugin", "test"])
        .arg(file)
        .arg("--config")
        .arg(config)
        .args(["--payload", "-", "--json"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(payload.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap(), report)
}

async fn count(env: &TestEnv, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(&env.pool)
        .await
        .unwrap()
}

/// Inventory untouched, no marker, no outbox row: what a rolled-back rehearsal leaves.
async fn assert_untouched(env: &TestEnv, what: &str) {
    let (available, reserved): (i64, i64) =
        sqlx::query_as("SELECT available, reserved FROM inventory WHERE sku = 'sku-1'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!((available, reserved), (10, 0), "{what}: inventory changed");
    assert_eq!(
        count(env, "SELECT count(*) FROM processed_message").await,
        0,
        "{what}: a marker was left"
    );
    assert_eq!(
        count(env, "SELECT count(*) FROM outbox_message").await,
        0,
        "{what}: an outbox row was left"
    );
}

#[tokio::test]
async fn plugin_test_rehearses_each_outcome_of_the_inventory_plugins_and_leaves_nothing() {
    let env = TestEnv::new("plugin_test").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let dir = scratch("plugin-test");
    let order = order_payload("o-1", "sku-1", 2);
    for plugin in ["inventory", "inventory-py", "inventory-js", "inventory-c"] {
        let name = format!("{plugin}-v1");
        let config = write_config(
            &dir,
            &env,
            &name,
            &plugin_path(plugin),
            "tables = [\"inventory\"]",
        );
        let file = plugin_path(plugin);
        let typed = ["--event-type", "OrderPlaced"];

        // Applied: the plugin's UPDATE ran (one row) and was rolled back with the claim.
        let (code, r) = plugin_test(
            &file,
            &config,
            &order,
            &[&typed[..], &["--id", "evt-a"]].concat(),
        );
        assert_eq!(
            (code, r["outcome"].as_str()),
            (0, Some("applied")),
            "{plugin}: {r:#}"
        );
        assert_eq!(r["committed"], false, "{plugin}");
        let statements = r["statements"].as_array().unwrap();
        assert!(
            statements
                .iter()
                .any(|s| s["sql"].as_str().unwrap().contains("UPDATE inventory")
                    && s["rows_affected"] == 1
                    && s["params"][0] == 2),
            "{plugin}: {r:#}"
        );
        assert!(
            r["timings_ms"]["instantiate"].as_f64().unwrap() > 0.0,
            "{plugin}"
        );
        assert_untouched(&env, plugin).await;

        // Duplicate: a committed marker for the id; the plugin is never called.
        sqlx::query(
            "INSERT INTO processed_message (consumer_name, message_id) VALUES ($1, 'evt-dup')",
        )
        .bind(&name)
        .execute(&env.pool)
        .await
        .unwrap();
        let (code, r) = plugin_test(
            &file,
            &config,
            &order,
            &[&typed[..], &["--id", "evt-dup"]].concat(),
        );
        assert_eq!(
            (code, r["outcome"].as_str()),
            (3, Some("duplicate")),
            "{plugin}: {r:#}"
        );
        assert_eq!(r["statements"].as_array().unwrap().len(), 0, "{plugin}");
        sqlx::query("DELETE FROM processed_message")
            .execute(&env.pool)
            .await
            .unwrap();

        // Terminal: a payload the plugin cannot read.
        let (code, r) = plugin_test(&file, &config, r#"{"orderId": 5}"#, &typed);
        assert_eq!(
            (code, r["outcome"].as_str()),
            (5, Some("terminal")),
            "{plugin}: {r:#}"
        );
        assert!(
            r["reason"].as_str().unwrap().contains("malformed"),
            "{plugin}: {r:#}"
        );
        assert_untouched(&env, plugin).await;
    }

    // Traps: the inventory plugins have no input that traps; the conformance plugins'
    // `conformance.trap` (a panic, an uncaught exception, `__builtin_trap()`) does, in the same
    // four languages.
    for template in [
        "conformance-rust",
        "conformance-py",
        "conformance-js",
        "conformance-c",
    ] {
        let config = write_config(&dir, &env, template, &plugin_path(template), "");
        let (code, r) = plugin_test(
            &plugin_path(template),
            &config,
            "{}",
            &["--event-type", "conformance.trap"],
        );
        assert_eq!(
            (code, r["outcome"].as_str()),
            (6, Some("trap")),
            "{template}: {r:#}"
        );
        assert!(
            r["reason"].as_str().unwrap().starts_with("plugin trapped"),
            "{r:#}"
        );
    }
    assert_untouched(&env, "after the traps").await;
    env.cleanup().await;
}

#[tokio::test]
async fn plugin_test_shows_outbox_events_and_commits_only_when_told() {
    let env = TestEnv::new("plugin_test_outbox").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    sqlx::raw_sql(include_str!(
        "../../examples/order-flow/migrations/0002_order_flow.sql"
    ))
    .execute(&env.pool)
    .await
    .unwrap();
    let dir = scratch("plugin-test-outbox");
    let plugin = plugin_path("order-reservation");
    let config = write_config(
        &dir,
        &env,
        "inventory-reservation-v1",
        &plugin,
        "tables = [\"*\"]\npublish_subjects = [\"demo.>\"]",
    );
    let order = r#"{"orderId":"o-7","sku":"sku-1","quantity":3}"#;
    let args = [
        "--event-type",
        "OrderPlaced",
        "--id",
        "evt-7",
        "--header",
        "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ];
    let (code, r) = plugin_test(&plugin, &config, order, &args);
    assert_eq!((code, r["outcome"].as_str()), (0, Some("applied")), "{r:#}");
    let outbox = r["outbox"].as_array().unwrap();
    assert_eq!(outbox.len(), 1, "{r:#}");
    assert_eq!(outbox[0]["subject"], "demo.inventory.reserved", "{r:#}");
    assert!(
        outbox[0]["payload"].as_str().unwrap().contains("o-7"),
        "{r:#}"
    );
    assert!(
        r["message"]["headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "traceparent"),
        "{r:#}"
    );
    assert_untouched(&env, "rehearsal").await;

    // --commit: the marker, the effect and the outbox row are committed together.
    let (code, r) = plugin_test(
        &plugin,
        &config,
        order,
        &[&args[..], &["--commit"]].concat(),
    );
    assert_eq!((code, r["committed"].as_bool()), (0, Some(true)), "{r:#}");
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM processed_message WHERE message_id = 'evt-7'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&env, "SELECT reserved FROM inventory WHERE sku = 'sku-1'").await,
        3
    );
    assert_eq!(count(&env, "SELECT count(*) FROM outbox_message").await, 1);
    // And the same id again is a duplicate.
    let (code, r) = plugin_test(&plugin, &config, order, &args);
    assert_eq!(
        (code, r["outcome"].as_str()),
        (3, Some("duplicate")),
        "{r:#}"
    );
    env.cleanup().await;
}

/// `plugin new` makes a project in each language that `plugin build` builds, into the same
/// bytes again from a copy with other file times (Python and JavaScript pinned, from the
/// project's `build-seed`), and that `plugin test` applies. One test per language, so that
/// they run side by side.
async fn a_new_project_builds_and_applies(lang: &str) {
    let env = TestEnv::new(&format!("plugin_new_{lang}")).await;
    let dir = scratch(&format!("plugin-new-{lang}"));
    let name = format!("notes-{lang}");
    let project = dir.join(&name);
    // The editor types come from the toolchain scripts/build-plugins.sh installed: two tests
    // installing one into the default place at once (a fresh machine) broke each other's.
    let created = run_ok(
        toolchain_env(&mut Command::new(BIN))
            .args(["plugin", "new", "--lang", lang, &name])
            .arg(&project),
    );
    let shown = String::from_utf8_lossy(&created.stdout);
    assert!(shown.contains("idemhost plugin build"), "{shown}");
    assert!(!shown.contains("not written"), "{shown}");
    if lang == "rust" {
        assert!(
            shown.contains("cargo build --release --target wasm32-wasip2"),
            "{shown}"
        );
    }
    let build = |dir: &Path| {
        run_ok(
            toolchain_env(&mut Command::new(BIN))
                .args(["plugin", "build"])
                .arg(dir),
        )
    };
    if matches!(lang, "python" | "js") {
        editor_types_check_the_handler(lang, &project);
        let seed = std::fs::read_to_string(project.join("build-seed")).unwrap();
        assert!(
            seed.trim().len() == 16 && seed.trim().bytes().all(|b| b.is_ascii_hexdigit()),
            "{lang}: build-seed {seed:?}"
        );
    }
    // plugin build keeps the editor types current: a removed one is back after it.
    let stub = match lang {
        "python" => Some(project.join("typings/wit_world/imports/database.py")),
        "js" => Some(project.join("types/interfaces/idemhost-consumer-database.d.ts")),
        _ => None,
    };
    if let Some(stub) = &stub {
        std::fs::remove_file(stub).unwrap();
    }
    let built = build(&project);
    if let Some(stub) = &stub {
        assert!(
            stub.is_file(),
            "{lang}: {} not written again",
            stub.display()
        );
    }
    // build-plugins.sh installed each toolchain where plugin build looks for it: nothing
    // is installed again (offline, under unshare -n, an install would need a registry).
    let said = String::from_utf8_lossy(&built.stderr);
    assert!(!said.contains("== installing"), "{lang}: {said}");
    {
        // Reproducible: the same source in another directory, with other file times,
        // builds the same bytes, in every language. (Python's and JavaScript's toolchains
        // snapshot a running interpreter: they build pinned, from the project's seed.)
        let copy = dir.join(format!("{name}-copy"));
        run_ok(Command::new("cp").arg("-r").arg(&project).arg(&copy));
        run_ok(Command::new("find").arg(&copy).args([
            "-exec",
            "touch",
            "-d",
            "2001-02-03 04:05:06",
            "{}",
            "+",
        ]));
        // Built again, not found built: the copy's output removed and, for Rust, the
        // package's artifacts in the shared target directory (cargo would take the copy,
        // same name, older files, for the project already built).
        std::fs::remove_file(copy.join("plugin.wasm")).unwrap();
        if lang == "rust" {
            run_ok(
                toolchain_env(&mut Command::new("cargo"))
                    .args([
                        "clean",
                        "--release",
                        "--target",
                        "wasm32-wasip2",
                        "-p",
                        &name,
                    ])
                    .arg("--manifest-path")
                    .arg(copy.join("Cargo.toml")),
            );
        }
        let rebuilt = build(&copy);
        if lang == "rust" {
            let said = String::from_utf8_lossy(&rebuilt.stderr);
            assert!(said.contains(&format!("Compiling {name}")), "{said}");
        }
        assert!(
            std::fs::read(project.join("plugin.wasm")).unwrap()
                == std::fs::read(copy.join("plugin.wasm")).unwrap(),
            "{lang}: two builds of the same source differ"
        );
    }
    // The project's table in the test's schema, and its config pointed there.
    project_table(&env, &project, &name).await;
    let out = Command::new(BIN)
        .args(["plugin", "test", "plugin.wasm", "--config", "idemhost.toml"])
        .args([
            "--payload",
            "sample.json",
            "--event-type",
            "NoteAdded",
            "--json",
        ])
        .current_dir(&project)
        .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
        .env("IDEMHOST_POSTGRES__SCHEMA", &env.schema)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{lang}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(
        (out.status.code(), r["outcome"].as_str()),
        (Some(0), Some("applied")),
        "{lang}: {r:#}"
    );
    let insert = &r["statements"][0];
    assert!(
        insert["sql"]
            .as_str()
            .unwrap()
            .starts_with("INSERT INTO note"),
        "{lang}: {r:#}"
    );
    assert_eq!(insert["rows_affected"], 1, "{lang}: {r:#}");
    assert_eq!(insert["params"][1], "hello", "{lang}: {r:#}");
    assert!(!r["logs"].as_array().unwrap().is_empty(), "{lang}: {r:#}");
    assert_eq!(
        count(&env, "SELECT count(*) FROM note").await,
        0,
        "{lang}: rolled back"
    );
    assert_eq!(
        count(&env, "SELECT count(*) FROM processed_message").await,
        0,
        "{lang}"
    );
    sqlx::raw_sql("DROP TABLE note")
        .execute(&env.pool)
        .await
        .unwrap();
    env.cleanup().await;
}

#[tokio::test]
async fn plugin_new_rust_project_builds_reproducibly_and_applies() {
    a_new_project_builds_and_applies("rust").await;
}

#[tokio::test]
async fn plugin_new_python_project_builds_reproducibly_and_applies() {
    a_new_project_builds_and_applies("python").await;
}

#[tokio::test]
async fn plugin_new_js_project_builds_reproducibly_and_applies() {
    a_new_project_builds_and_applies("js").await;
}

#[tokio::test]
async fn plugin_new_c_project_builds_reproducibly_and_applies() {
    a_new_project_builds_and_applies("c").await;
}

/// The toolchains build-plugins.sh installed, and the plugins' cargo target directory (where
/// the Rust template's dependencies are already built).
fn toolchain_env(command: &mut Command) -> &mut Command {
    let cargo_target = String::from_utf8(
        run_ok(
            Command::new("bash")
                .arg("scripts/target-dir.sh")
                .arg("plugins/Cargo.toml")
                .current_dir(repo_root()),
        )
        .stdout,
    )
    .unwrap();
    without_lints(command)
        .env(
            "IDEMHOST_TOOLCHAIN_DIR",
            repo_root().join(".cache/toolchain"),
        )
        .env("CARGO_TARGET_DIR", cargo_target.trim())
}

/// A new project's note table in the test's schema.
async fn project_table(env: &TestEnv, project: &Path, name: &str) {
    let schema_sql = std::fs::read_to_string(project.join("schema.sql"))
        .unwrap()
        .replace(&name.replace('-', "_"), &env.schema);
    sqlx::raw_sql(sqlx::AssertSqlSafe(schema_sql))
        .execute(&env.pool)
        .await
        .unwrap();
}

/// `plugin dev`, the author's loop in one command: watching a new Rust project it builds and
/// runs the sample at once (applied, rolled back); an edit that breaks the build shows the
/// compiler's own error and no backtrace though `RUST_BACKTRACE` is set; the fix applies
/// again. `--once` on a Python project with a syntax error exits 1 with Python's error in a
/// few lines (componentize-py, a Rust program, printed 68 lines of Rust backtrace with it).
#[tokio::test]
async fn plugin_dev_builds_and_runs_the_samples_on_every_change() {
    use std::io::BufRead as _;
    use std::time::{Duration, Instant};
    let env = TestEnv::new("plugin_dev").await;
    let dir = scratch("plugin-dev");
    let name = "notes-dev";
    let project = dir.join(name);
    run_ok(
        Command::new(BIN)
            .args(["plugin", "new", "--lang", "rust", name])
            .arg(&project),
    );
    project_table(&env, &project, name).await;
    let mut child = toolchain_env(&mut Command::new(BIN))
        .args(["plugin", "dev"])
        .arg(&project)
        .args(["--event-type", "NoteAdded", "--poll", "100ms"])
        .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
        .env("IDEMHOST_POSTGRES__SCHEMA", &env.schema)
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _stop = KillOnDrop(child.id());
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The lines printed until one containing `until`, within `limit`.
    let until = |needle: &str, limit: Duration| -> Vec<String> {
        let end = Instant::now() + limit;
        let mut lines = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(needle);
                    lines.push(line);
                    if found {
                        return lines;
                    }
                }
                Err(_) => panic!(
                    "no {needle:?} within {limit:?}; printed:\n{}",
                    lines.join("\n")
                ),
            }
        }
    };
    let first = until("-- watching", Duration::from_secs(600));
    let first = first.join("\n");
    assert!(first.contains("built "), "{first}");
    assert!(
        first.contains("sample.json: applied: 2 statements"),
        "{first}"
    );
    let lib = project.join("src/lib.rs");
    let good = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(&lib, format!("{good}\nfn broken( {{\n")).unwrap();
    let broken = until("-- watching", Duration::from_secs(300)).join("\n");
    assert!(broken.contains("build failed"), "{broken}");
    assert!(broken.contains("error"), "{broken}");
    assert!(!broken.contains("stack backtrace"), "{broken}");
    assert!(
        !broken.contains("sample.json"),
        "no samples after a failed build: {broken}"
    );
    std::fs::write(&lib, &good).unwrap();
    let fixed = until("-- watching", Duration::from_secs(300)).join("\n");
    assert!(fixed.contains("sample.json: applied"), "{fixed}");
    drop(_stop);
    let _ = child.wait();
    assert_eq!(
        count(&env, "SELECT count(*) FROM note").await,
        0,
        "rolled back"
    );

    // Python, once, with a syntax error.
    let py = dir.join("notes-dev-py");
    run_ok(
        toolchain_env(&mut Command::new(BIN))
            .args(["plugin", "new", "--lang", "python", "notes-dev-py"])
            .arg(&py),
    );
    let app = py.join("app.py");
    let source = std::fs::read_to_string(&app).unwrap();
    std::fs::write(&app, format!("{source}\ndef broken(:\n    pass\n")).unwrap();
    let out = toolchain_env(&mut Command::new(BIN))
        .args(["plugin", "dev", "--once", "--event-type", "NoteAdded"])
        .arg(&py)
        .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
        .env("IDEMHOST_POSTGRES__SCHEMA", &env.schema)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(shown.contains("SyntaxError"), "{shown}");
    assert!(!shown.contains("stack backtrace"), "{shown}");
    assert!(
        shown.lines().count() <= 45,
        "{} lines:\n{shown}",
        shown.lines().count()
    );
    env.cleanup().await;
}

/// Ends a process (and so a watch loop) when dropped, also when a test fails.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0 as i32, libc::SIGTERM) };
    }
}

/// `idemhost plugin test` of the Rust conformance plugin without `--config`, on `schema`, asking the
/// plugin to fail retryably (exit status 4), with `extra` arguments.
fn template_retry_without_config(schema: &str, extra: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(["plugin", "test"])
        .arg(plugin_path("conformance-rust"))
        .args([
            "--payload",
            "/dev/null",
            "--event-type",
            "conformance.retry",
            "--json",
        ])
        .args(extra)
        .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
        .env("IDEMHOST_POSTGRES__SCHEMA", schema)
        .env_remove("IDEMHOST_CONFIG")
        .output()
        .unwrap()
}

/// Without `--config`: the defaults (environment overrides applied) and a consumer named after
/// the file — here a retryable outcome, exit status 4.
#[tokio::test]
async fn plugin_test_without_a_config_runs_as_a_consumer_named_after_the_file() {
    let env = TestEnv::new("plugin_test_noconfig").await;
    let out = template_retry_without_config(&env.schema, &[]);
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(
        (
            out.status.code(),
            r["outcome"].as_str(),
            r["consumer"].as_str()
        ),
        (Some(4), Some("retryable"), Some("conformance-rust")),
        "{r:#}"
    );
    assert_eq!(r["reason"], "conformance: retry requested", "{r:#}");
    assert_eq!(
        count(&env, "SELECT count(*) FROM processed_message").await,
        0
    );
    env.cleanup().await;
}

/// A hostile plugin's output reaches the developer's terminal: escape sequences in its log
/// lines, outbox subject and headers are shown as spaces, and a statement loop is kept to the
/// trace's bound (the rest counted).
#[tokio::test]
async fn plugin_test_shows_hostile_plugin_output_safely_and_bounded() {
    let env = TestEnv::new("plugin_test_hostile").await;
    let dir = scratch("plugin-test-hostile");
    let plugin = plugin_path("testkit");
    let config = write_config(&dir, &env, "hostile", &plugin, "publish_subjects = [\">\"]");
    let esc = "\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}31m";
    let mut steps: Vec<Value> = (0..1100)
        .map(|_| serde_json::json!({"query": "SELECT 1"}))
        .collect();
    steps.push(serde_json::json!({"log": format!("log {esc}"), "times": 1}));
    steps.push(serde_json::json!({
        "publish": format!("demo.{esc}"), "payload": format!("payload {esc}"),
        "headers": [[format!("X-{esc}"), format!("value {esc}")]],
    }));
    let payload = serde_json::json!({ "steps": steps }).to_string();
    let out = Command::new(BIN)
        .args(["plugin", "test"])
        .arg(&plugin)
        .arg("--config")
        .arg(&config)
        .args(["--payload", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            child.stdin.take().unwrap().write_all(payload.as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("SQL: 1000 statements, 100 more not kept"),
        "{text}"
    );
    assert!(text.contains("log "), "{text}");
    assert!(text.contains("REFUSED"), "{text}");
    let controls: Vec<char> = text
        .chars()
        .filter(|c| c.is_control() && *c != '\n')
        .collect();
    assert!(
        controls.is_empty(),
        "control characters reached the terminal: {controls:?}"
    );
    assert_eq!(out.status.code(), Some(4), "{text}");
    env.cleanup().await;
}

/// The instance pool is sized by the consumer's `memory_limit`, as the host sizes it: a plugin
/// that grows to 80 MiB under a 96 MiB limit runs (a default 64 MiB pool refused it).
#[tokio::test]
async fn plugin_test_runs_under_the_consumers_memory_limit() {
    let env = TestEnv::new("plugin_test_memory").await;
    let dir = scratch("plugin-test-memory");
    let plugin = plugin_path("testkit");
    let config = write_config(&dir, &env, "big", &plugin, "memory_limit = \"96MiB\"");
    let (code, r) = plugin_test(&plugin, &config, r#"{"steps": [{"alloc_mib": 80}]}"#, &[]);
    assert_eq!((code, r["outcome"].as_str()), (0, Some("applied")), "{r:#}");
    env.cleanup().await;
}

/// A plugin that never returns is ended at the consumer's `handler_timeout` under `plugin
/// test`, as in a delivery. It ran for ever before: the command dropped the runtime after
/// loading the plugin, and with it the clock that ends a call. (A watchdog kills the command
/// after 60 s so that the failure shows rather than hangs the suite.)
#[tokio::test]
async fn plugin_test_ends_a_plugin_that_never_returns_at_its_timeout() {
    let env = TestEnv::new("plugin_test_loop").await;
    let dir = scratch("plugin-test-loop");
    let plugin = plugin_path("testkit");
    let config = write_config(&dir, &env, "looping", &plugin, "handler_timeout = \"1s\"");
    let payload = dir.join("loop.json");
    std::fs::write(&payload, r#"{"steps": ["loop"]}"#).unwrap();
    let mut child = Command::new(BIN)
        .args(["plugin", "test"])
        .arg(&plugin)
        .arg("--config")
        .arg(&config)
        .arg("--payload")
        .arg(&payload)
        .arg("--json")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let status = status.expect("plugin test still ran a looping plugin after 60 s");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let r: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(status.code(), Some(6), "{r:#}");
    assert_eq!(r["outcome"], "trap", "{r:#}");
    env.cleanup().await;
}

/// A hostile plugin run through `plugin test` by an operator whose config logs the host in as a
/// superuser (as here): the rehearsal runs on the consumer's own role, like a delivery, so the
/// plugin cannot use the operator's session (a superuser reads `pg_authid`, the password
/// hashes; the plugin's role is denied).
#[tokio::test]
async fn plugin_test_runs_the_plugin_as_its_role_not_as_the_operator() {
    let env = TestEnv::new("plugin_test_role").await;
    let dir = scratch("plugin-test-role");
    let plugin = plugin_path("testkit");
    let config = write_config(&dir, &env, "curious", &plugin, "");
    let steps = r#"{"keep_going": true, "steps": [
        {"query": "SELECT current_user::text, (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"},
        {"query": "SELECT count(*) FROM pg_authid"}
    ]}"#;
    let (_, r) = plugin_test(&plugin, &config, steps, &[]);
    let who = &r["statements"][0]["rows"][0];
    assert_eq!(who[0], r["role"], "{r:#}");
    assert_ne!(who[0], "root", "{r:#}");
    assert_eq!(who[1], false, "the plugin ran as a superuser: {r:#}");
    let read = &r["statements"][1];
    assert!(read["rows"].is_null(), "the role read pg_authid: {r:#}");
    // Refused before the server sees it: the role has no privilege on it.
    assert!(
        read["error"]
            .as_str()
            .unwrap()
            .contains("`pg_authid` is a relation this consumer's role has no privilege on"),
        "{r:#}"
    );
    env.cleanup().await;
}

/// `plugin test` (rolled back) leaves the server as it found it, its own set-up included: on a
/// schema that did not exist, the schema it made for the host's migrations and the consumer's
/// role are gone afterwards; on a schema holding only the developer's table, the host's tables
/// and functions go and that table stays; `--keep-setup` keeps them; a schema with only some
/// of the host's migrations is refused untouched. Before, each run left a migrated schema and
/// a cluster-wide role behind.
#[tokio::test]
async fn plugin_test_takes_back_its_own_setup_unless_asked() {
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&PG_URL)
        .await
        .unwrap();
    let scalar = server_scalar;
    let run = template_retry_without_config;
    let role_of = |schema: &str| {
        let text = format!(
            "[postgres]\nurl = \"{PG_URL}\"\nschema = \"{schema}\"\n[[consumer]]\nname = \"conformance-rust\"\n\
             stream = \"S\"\nplugin = \"x.wasm\"\n"
        );
        let config = parse_config(&text);
        idemhost::test_support::pg::wall::plugin_role(&config.postgres, &config.consumers[0])
    };
    let roles = |role: String| {
        scalar(format!(
            "SELECT count(*) FROM pg_roles WHERE rolname = '{role}'"
        ))
    };
    let schemas = |schema: String| {
        scalar(format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{schema}'"
        ))
    };

    // A schema that does not exist.
    let fresh = format!("t_{}", unique("pt_fresh"));
    let out = run(&fresh, &[]);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(4), "{report:#}");
    // The host's tables and functions, the schema, the role.
    assert_eq!(
        report["setup_removed"].as_array().map(Vec::len),
        Some(3),
        "{report:#}"
    );
    assert_eq!(
        report["setup_kept"].as_array().map(Vec::len),
        Some(0),
        "{report:#}"
    );
    assert_eq!(schemas(fresh.clone()).await, 0, "the schema was left");
    assert_eq!(roles(role_of(&fresh)).await, 0, "the role was left");

    // A schema with the developer's own table and none of the host's.
    let own = format!("t_{}", unique("pt_own"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {own}; CREATE TABLE {own}.notes (id int); INSERT INTO {own}.notes VALUES (7)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let out = run(&own, &[]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(scalar(format!("SELECT count(*) FROM {own}.notes")).await, 1);
    assert_eq!(
        scalar(format!(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = '{own}' AND c.relkind = 'r'"
        ))
        .await,
        1,
        "only the developer's table is left"
    );
    assert_eq!(
        scalar(format!(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = '{own}'"
        ))
        .await,
        0,
        "the host's functions were left"
    );
    assert_eq!(roles(role_of(&own)).await, 0);

    // Asked to keep it: the migrations and the role stay.
    let out = run(&own, &["--keep-setup"]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(scalar(format!("SELECT count(*) FROM {own}._sqlx_migrations")).await > 10);
    assert_eq!(roles(role_of(&own)).await, 1);

    // Only some of the host's migrations: refused, nothing applied.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {own}._sqlx_migrations WHERE version >= 12"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let out = run(&own, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("idemhost migrate") && stderr.contains("--keep-setup"),
        "{stderr}"
    );
    assert_eq!(
        scalar(format!(
            "SELECT count(*) FROM {own}._sqlx_migrations WHERE version >= 12"
        ))
        .await,
        0
    );

    let role = role_of(&own);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {own} CASCADE; DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""
    )))
    .execute(&admin)
    .await
    .unwrap();
}

/// A new Python or JavaScript project's editor types check its handler with the language's
/// own checker (mypy, tsc): the template passes, and a misspelt method of the transaction is
/// an error naming it (so the types are the world's, not `any`).
fn editor_types_check_the_handler(lang: &str, project: &Path) {
    let tools = repo_root().join(".cache/toolchain");
    let (source, checker, args): (&str, PathBuf, &[&str]) = match lang {
        "python" => ("app.py", tools.join("mypy/bin/mypy"), &[]),
        _ => (
            "handler.js",
            tools.join("js/node_modules/.bin/tsc"),
            &["-p", "jsconfig.json"],
        ),
    };
    let check = || {
        Command::new(&checker)
            .args(args)
            .current_dir(project)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (scripts/build-plugins.sh installs it)",
                    checker.display()
                )
            })
    };
    let out = check();
    assert!(out.status.success(), "{lang}: {out:?}");
    let path = project.join(source);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("tx.execute("), "{lang}");
    std::fs::write(&path, text.replace("tx.execute(", "tx.exeucte(")).unwrap();
    let out = check();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && said.contains("exeucte"),
        "{lang}: {out:?}"
    );
    std::fs::write(&path, text).unwrap();
}
