//! The binary's start-up errors: each names the key, file or (redacted) URL that is wrong, and
//! exits non-zero before consuming anything.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

fn run_with(dir: &Path, toml: &str) -> (bool, String) {
    let path = dir.join("idemhost.toml");
    std::fs::write(&path, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .arg("run")
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn consumer(plugin: &Path, stream: &str) -> String {
    format!(
        "[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"c1\"\nstream = \"{stream}\"\nsubjects = [\"x.y\"]\nplugin = \"{}\"\n",
        plugin.display()
    )
}

fn tmpdir() -> PathBuf {
    let d = std::env::temp_dir().join(unique("idemhost_cli"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Unreachable servers and bad config are reported clearly, with passwords redacted.
#[tokio::test]
async fn startup_errors_name_what_is_wrong() {
    let dir = tmpdir();
    let plugin = plugin_path("inventory");
    let schema = unique("t_cli");
    let good_pg = format!("[postgres]\nurl = \"{PG_URL}\"\nschema = \"{schema}\"\n");
    // The suite's NATS (not the default address, where nothing may answer).
    let good_nats = format!("[nats]\nurl = \"{NATS_URL}\"\n");

    let (ok, err) = run_with(
        &dir,
        &format!(
            "{good_nats}[postgres]\nurl = \"postgres://app:s3cret@127.0.0.1:1/x\"\nacquire_timeout = \"1s\"\n{}",
            consumer(&plugin, "S")
        ),
    );
    assert!(!ok);
    assert!(
        err.contains("failed to connect to PostgreSQL at postgres://app:***@127.0.0.1:1/x"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");

    let (ok, err) = run_with(
        &dir,
        &format!(
            "[nats]\nurl = \"nats://127.0.0.1:1\"\nconnect_timeout = \"1s\"\n{good_pg}{}",
            consumer(&plugin, "S")
        ),
    );
    assert!(!ok);
    assert!(
        err.contains("failed to connect to NATS at nats://127.0.0.1:1"),
        "{err}"
    );

    let (ok, err) = run_with(
        &dir,
        &format!(
            "{good_nats}{good_pg}{}max_in_flight = 0\n",
            consumer(&plugin, "S")
        ),
    );
    assert!(!ok);
    assert!(
        err.contains("consumer[0].max_in_flight") && err.contains("between 1 and 4096"),
        "{err}"
    );

    let (ok, err) = run_with(
        &dir,
        &format!(
            "{good_nats}{good_pg}{}handler_timeout = \"soon\"\n",
            consumer(&plugin, "S")
        ),
    );
    assert!(!ok);
    assert!(err.contains("invalid duration \"soon\""), "{err}");

    let (ok, err) = run_with(
        &dir,
        &format!(
            "{good_nats}{good_pg}{}",
            consumer(&dir.join("missing.wasm"), "S")
        ),
    );
    assert!(!ok);
    assert!(
        err.contains("consumer c1") && err.contains("missing.wasm"),
        "{err}"
    );

    let junk = dir.join("junk.wasm");
    std::fs::write(&junk, b"\0asm not really").unwrap();
    let (ok, err) = run_with(
        &dir,
        &format!("{good_nats}{good_pg}{}", consumer(&junk, "S")),
    );
    assert!(!ok);
    assert!(
        err.contains("is not a valid WebAssembly component"),
        "{err}"
    );

    let (ok, err) = run_with(
        &dir,
        &format!(
            "{good_nats}{good_pg}{}",
            consumer(&plugin, &unique("NO_SUCH_STREAM").to_uppercase())
        ),
    );
    assert!(!ok);
    assert!(
        err.contains("not found (create it, or set create_stream = true)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let admin = sqlx::PgPool::connect(&PG_URL).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&admin)
    .await
    .unwrap();
}

/// Each required key missing in turn, a wrong type, and a plugin path that does not exist:
/// a one-line error naming the problem, exit 1, no panic.
#[tokio::test]
async fn missing_or_wrong_keys_are_one_line_errors() {
    let dir = tmpdir();
    let plugin = plugin_path("inventory");
    let schema = unique("t_cli_keys");
    let pg = format!("[postgres]\nurl = \"{PG_URL}\"\nschema = \"{schema}\"\n");
    let full = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{pg}[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"c1\"\nstream = \"S\"\nplugin = \"{}\"\n",
        plugin.display()
    );
    let cases = [
        (full.replace(&pg, ""), "postgres"),
        (full.replace(&format!("url = \"{PG_URL}\"\n"), ""), "url"),
        (full.replace("name = \"c1\"\n", ""), "name"),
        (full.replace("stream = \"S\"\n", ""), "stream"),
        (full.replace("stream = \"S\"", "stream = 7"), "stream"),
        (
            full.replace(&plugin.display().to_string(), "/nonexistent/p.wasm"),
            "/nonexistent/p.wasm",
        ),
    ];
    for (toml, needle) in cases {
        let (ok, err) = run_with(&dir, &toml);
        assert!(!ok, "{toml}");
        // Log lines (from the tracing subscriber: colored, or starting with their timestamp)
        // may come before or after it; every other line is the error's, and there must be
        // exactly one, naming the problem.
        let not_log: Vec<&str> = err
            .lines()
            .filter(|l| !l.trim().is_empty())
            .filter(|l| !l.starts_with('\u{1b}') && !l.starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        assert_eq!(not_log.len(), 1, "{needle}: one error line: {err}");
        assert!(
            not_log[0].starts_with("error: ") && not_log[0].contains(needle),
            "{needle}: {err}"
        );
        assert_eq!(err.matches("error: ").count(), 1, "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&PG_URL)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&admin)
    .await
    .unwrap();
}

/// `plugin check` says which version of the WIT package a component was built against, for a
/// component of every language, and names a refused one's reason with a non-zero exit.
#[test]
fn plugin_check_names_the_wit_version_a_component_targets() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wit-0.1.0");
    // The compiled languages' builds: the conformance suite checks every language's version
    // through `LoadInfo::world` (compiling an interpreter's component here took 10-20 s each).
    let builds = [
        (plugin_path("inventory"), "0.2.0"),
        (plugin_path("inventory-c"), "0.2.0"),
        (plugin_path("testkit"), "0.1.0"),
        (fixtures.join("template-rust.wasm"), "0.1.0"),
        (fixtures.join("template-c.wasm"), "0.1.0"),
    ];
    for (path, version) in builds {
        let out = run_ok(
            Command::new(env!("CARGO_BIN_EXE_idemhost"))
                .args(["plugin", "check"])
                .arg(&path),
        );
        let said = String::from_utf8_lossy(&out.stdout);
        let targets = format!("idemhost:consumer@{version}");
        assert!(
            said.lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["targets", &targets]),
            "{}: {said}",
            path.display()
        );
    }
    // What `plugin check` says of a component built from `wat`: it must be refused.
    let dir = tmpdir();
    let refusal = |name: &str, wat: &str| {
        let file = dir.join(name);
        std::fs::write(&file, wat::parse_str(wat).unwrap()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .args(["plugin", "check"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name}: {out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // One version throughout: a 0.2.0 export with a 0.1.0 import is refused.
    let said = refusal(
        "mixed.wasm",
        r#"(component
             (import "idemhost:consumer/database@0.1.0" (instance))
             (instance $h)
             (export "idemhost:consumer/handling@0.2.0" (instance $h)))"#,
    );
    assert!(
        said.contains("targets one version of idemhost:consumer"),
        "{said}"
    );
    let said = refusal(
        "other-version.wasm",
        r#"(component (import "idemhost:consumer/database@0.9.0" (instance)))"#,
    );
    assert!(
        said.contains("this host speaks idemhost:consumer@0.1.x and 0.2.x"),
        "{said}"
    );
}
