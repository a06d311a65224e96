//! `idemhost plugin new` and `idemhost plugin build`: a plugin project from the templates in
//! one of four languages, and one command that builds any of them into `plugin.wasm` with the
//! toolchains the project pins (installed on first use into a cache: see [`toolchain_dir`]).
//! The templates, the WIT, the C bindings and the pinned toolchain lists are compiled into the
//! binary, so neither command needs this repository.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use sha2::Digest as _;

use super::plugin_types;

/// A plugin language `plugin new` has a template for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
    C,
}

/// What a project builds into, in its directory.
pub const OUTPUT: &str = "plugin.wasm";

const WIT: &str = include_str!("../wit/0.2.0/consumer.wit");
const RUST_TEMPLATE: &str = include_str!("../plugins/templates/rust/src/lib.rs");
const RUST_LOCK: &str = include_str!("../plugins/Cargo.lock");
const PY_TEMPLATE: &str = include_str!("../plugins/templates/python/app.py");
const JS_TEMPLATE: &str = include_str!("../plugins/templates/js/template.js");
const C_TEMPLATE: &str = include_str!("../plugins/templates/c/template.c");
const C_FILES: [(&str, &[u8]); 6] = [
    (
        "bindings/handler.c",
        include_bytes!("../plugins/c-bindings/handler.c"),
    ),
    (
        "bindings/handler.h",
        include_bytes!("../plugins/c-bindings/handler.h"),
    ),
    (
        "bindings/handler_component_type.o",
        include_bytes!("../plugins/c-bindings/handler_component_type.o"),
    ),
    (
        "common/json_fields.c",
        include_bytes!("../plugins/c-common/json_fields.c"),
    ),
    (
        "common/json_fields.h",
        include_bytes!("../plugins/c-common/json_fields.h"),
    ),
    (
        "common/text.h",
        include_bytes!("../plugins/c-common/text.h"),
    ),
];
const PY_REQUIREMENTS: &str = include_str!("../plugins/toolchain/requirements.txt");
const JS_PACKAGE: &str = include_str!("../plugins/toolchain/package.json");
const JS_LOCK: &str = include_str!("../plugins/toolchain/package-lock.json");
const C_APT_PACKAGES: &str = include_str!("../plugins/toolchain/apt-packages.txt");

/// The JavaScript engine's WASI features left out, so the component imports only the world.
const JS_DISABLED: [&str; 5] = ["stdio", "random", "clocks", "http", "fetch-event"];

/// Writes a new project for `name` into `dir` (which must not exist or be empty); returns the
/// text to show: what was written and the loop's commands.
pub fn new(lang: Lang, name: &str, dir: &Path) -> anyhow::Result<String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        || !name.starts_with(|c: char| c.is_ascii_lowercase())
    {
        bail!(
            "plugin name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter"
        );
    }
    if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        bail!("{} exists and is not empty", dir.display());
    }
    let schema = name.replace('-', "_");
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("wit/consumer.wit".into(), WIT.into()),
        ("idemhost.toml".into(), config(name, &schema).into_bytes()),
        ("schema.sql".into(), schema_sql(&schema).into_bytes()),
        (
            "sample.json".into(),
            b"{\"noteId\": \"n-1\", \"text\": \"hello\"}\n".to_vec(),
        ),
        (
            ".gitignore".into(),
            format!("/{OUTPUT}\n/target/\n/typings/\n/types/\n").into_bytes(),
        ),
        ("README.md".into(), readme(lang, name, &schema).into_bytes()),
    ];
    match lang {
        Lang::Rust => {
            files.push(("Cargo.toml".into(), cargo_toml(name).into_bytes()));
            files.push(("Cargo.lock".into(), RUST_LOCK.into()));
            let source = RUST_TEMPLATE.replace("path: \"../../../wit/0.2.0\"", "path: \"wit\"");
            files.push(("src/lib.rs".into(), source.into_bytes()));
        }
        Lang::Python | Lang::Js => {
            let (source, template) = match lang {
                Lang::Python => ("app.py", PY_TEMPLATE),
                _ => ("handler.js", JS_TEMPLATE),
            };
            files.push((source.into(), template.into()));
            let seed = super::plugin_repro::new_seed()?;
            files.push((super::plugin_repro::SEED_FILE.into(), seed.into_bytes()));
            files.push(match lang {
                Lang::Python => ("mypy.ini".into(), plugin_types::MYPY_INI.into()),
                _ => ("jsconfig.json".into(), plugin_types::JSCONFIG.into()),
            });
        }
        Lang::C => {
            files.push(("handler.c".into(), C_TEMPLATE.into()));
            files.extend(C_FILES.iter().map(|(p, b)| (p.to_string(), b.to_vec())));
        }
    }
    for (path, bytes) in &files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, bytes)
            .with_context(|| format!("failed to write {}", path.display()))?;
    }
    let d = dir.display();
    let types = match lang {
        Lang::Rust | Lang::C => String::new(),
        _ => match editor_types(dir, lang) {
            Ok(()) => format!(
                "types:  {d}/{}, for an editor ({}); plugin build keeps them current\n",
                if lang == Lang::Python {
                    "typings/"
                } else {
                    "types/"
                },
                if lang == Lang::Python {
                    "mypy.ini points mypy there"
                } else {
                    "tsc -p jsconfig.json checks handler.js"
                }
            ),
            Err(e) => format!("types:  not written ({e:#}); plugin build writes them\n"),
        },
    };
    Ok(format!(
        "created {d} ({lang:?} plugin {name:?}, {} files)\n\
         build:  idemhost plugin build {d}        # runs: {}\n\
         tables: psql postgres://root@127.0.0.1:5432/test -f {d}/schema.sql\n\
         test:   idemhost plugin test {d}/{OUTPUT} --config {d}/idemhost.toml --payload {d}/sample.json --event-type NoteAdded\n\
         loop:   idemhost plugin dev {d} --event-type NoteAdded   # builds and tests on every change\n",
        files.len(),
        build_command(lang),
    ) + &types)
}

/// The compiler command a project of `lang` is built with, as `plugin build` runs it.
fn build_command(lang: Lang) -> String {
    match lang {
        Lang::Rust => "cargo build --release --target wasm32-wasip2".into(),
        Lang::Python => format!(
            "componentize-py -d wit -w handler componentize --stub-wasi -p . app -o {OUTPUT}"
        ),
        Lang::Js => format!(
            "componentize-js handler.js --wit wit --world-name handler -d {} -o {OUTPUT}",
            JS_DISABLED.join(" ")
        ),
        Lang::C => format!(
            "clang-14 --target=wasm32-wasi ... handler.c, then wasm-tools component new -o {OUTPUT}"
        ),
    }
}

fn config(name: &str, schema: &str) -> String {
    format!(
        "# A development configuration for this plugin: `idemhost plugin test` reads PostgreSQL, the\n\
         # schema and the consumer's limits and grants from it; `idemhost run --config` consumes with it.\n\
         # Any key can be overridden by environment, e.g. IDEMHOST_POSTGRES__URL=postgres://app@db/app.\n\
         \n\
         [nats]\n\
         url = \"nats://127.0.0.1:4222\"\n\
         \n\
         [postgres]\n\
         url = \"postgres://root@127.0.0.1:5432/test\"\n\
         schema = \"{schema}\"\n\
         \n\
         [[consumer]]\n\
         name = \"{name}\"\n\
         stream = \"{stream}\"\n\
         subjects = [\"{name}.>\"]\n\
         create_stream = true\n\
         plugin = \"{OUTPUT}\"\n\
         # The tables the plugin's role may read and write (schema.sql creates them).\n\
         tables = [\"note\"]\n\
         \n\
         # The plugin's settings, read through its `config` interface (not for secrets).\n\
         [consumer.config]\n\
         max_note_bytes = 10000\n",
        stream = name.to_uppercase().replace('-', "_"),
    )
}

fn schema_sql(schema: &str) -> String {
    format!(
        "-- The plugin's own table, in the configuration's schema (the host creates its tables there\n\
         -- on `idemhost migrate`, `run` or `plugin test`).\n\
         CREATE SCHEMA IF NOT EXISTS {schema};\n\
         CREATE TABLE IF NOT EXISTS {schema}.note (\n    note_id    text PRIMARY KEY,\n    body       text NOT NULL,\n    message_id text NOT NULL\n);\n"
    )
}

fn cargo_toml(name: &str) -> String {
    format!(
        "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
         [lib]\ncrate-type = [\"cdylib\"]\n\n\
         [dependencies]\nwit-bindgen = \"0.61\"\nserde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n\n\
         [profile.release]\nopt-level = \"s\"\nlto = true\ncodegen-units = 1\nstrip = true\npanic = \"abort\"\n\n\
         # A project of its own, also when it sits inside another cargo workspace.\n[workspace]\n"
    )
}

fn readme(lang: Lang, name: &str, schema: &str) -> String {
    let source = match lang {
        Lang::Rust => "src/lib.rs",
        Lang::Python => "app.py",
        Lang::Js => "handler.js",
        Lang::C => "handler.c",
    };
    let extra = match lang {
        Lang::Python => {
            "\n`typings/` holds the world's types for an editor (pyright looks there; `mypy` here\n\
                         checks `app.py` against them, see `mypy.ini`). `build-seed` makes builds\n\
                         reproducible: commit it.\n"
        }
        Lang::Js => {
            "\n`types/` holds the world's types for an editor; `tsc -p jsconfig.json` checks\n\
                     `handler.js` against them. `build-seed` makes builds reproducible: commit it.\n"
        }
        Lang::Rust | Lang::C => "",
    };
    format!(
        "# {name}\n\n\
         An idemhost handler in {lang:?}, from `idemhost plugin new`. The handler is in `{source}`;\n\
         `wit/consumer.wit` is the world it implements (idemhost:consumer@0.2.0): database calls\n\
         fail with a typed error, and `config` reads the consumer's `[consumer.config]` table\n\
         (`max_note_bytes` in `idemhost.toml`).\n\n\
         ```sh\n\
         idemhost plugin build .            # {build}\n\
         psql postgres://root@127.0.0.1:5432/test -f schema.sql   # the note table, schema {schema}\n\
         idemhost plugin test {OUTPUT} --config idemhost.toml --payload sample.json --event-type NoteAdded\n\
         ```\n\n\
         `idemhost plugin dev . --event-type NoteAdded` does both on every change you save: it\n\
         builds (showing the build's output only when it fails) and runs each `sample*.json`\n\
         through the new component, a few lines per sample.\n\n\
         `plugin test` runs the message through the plugin as a delivery would and rolls back; it\n\
         prints each statement, the log lines, outbox events, the outcome and the timings. Deploy\n\
         with `idemhost plugin deploy --consumer {name} {OUTPUT} --config <the host's config>`.\n{extra}",
        build = build_command(lang),
    )
}

/// Builds the project in `dir` into `dir/plugin.wasm` with its language's pinned toolchain;
/// returns the output's path.
pub fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let lang = detect(dir)?;
    let out = dir.join(OUTPUT);
    match lang {
        Lang::Rust => build_rust(dir, &out)?,
        Lang::Python | Lang::Js => {
            // The editor's types first (not part of the component): a failure is only shown.
            if let Err(e) = editor_types(dir, lang) {
                eprintln!("== editor types not updated: {e:#}");
            }
            // Run from the directory plugin_repro stages the sources in (a fixed path).
            let (program, mut args, node) = if lang == Lang::Python {
                let py = python_tools()?.join("bin/componentize-py");
                let args = ["-d", "wit", "-w", "handler", "componentize", "--stub-wasi"];
                (py, [&args[..], &["-p", ".", "app"]].concat(), false)
            } else {
                let js = js_tools()?.join("node_modules/.bin/componentize-js");
                let args = [
                    "handler.js",
                    "--wit",
                    "wit",
                    "--world-name",
                    "handler",
                    "-d",
                ];
                (js, [&args[..], &JS_DISABLED].concat(), true)
            };
            args.extend(["-o", OUTPUT]);
            let step = |at: &Path| {
                let mut step = Command::new(&program);
                step.args(&args).current_dir(at);
                step
            };
            super::plugin_repro::build(dir, OUTPUT, node, step, run_named)?;
        }
        Lang::C => build_c(dir)?,
    }
    Ok(out)
}

/// The project's editor types (Python stubs, TypeScript declarations) from its WIT.
fn editor_types(dir: &Path, lang: Lang) -> anyhow::Result<()> {
    plugin_types::write(dir, lang, python_tools, js_tools, run)
}

/// The project's language, from the file its template put there.
fn detect(dir: &Path) -> anyhow::Result<Lang> {
    for (file, lang) in [
        ("Cargo.toml", Lang::Rust),
        ("app.py", Lang::Python),
        ("handler.js", Lang::Js),
        ("handler.c", Lang::C),
    ] {
        if dir.join(file).is_file() {
            return Ok(lang);
        }
    }
    bail!(
        "{}: not a plugin project (no Cargo.toml, app.py, handler.js or handler.c; `idemhost plugin new` makes one)",
        dir.display()
    )
}

fn build_rust(dir: &Path, out: &Path) -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output();
    if let Ok(o) = installed
        && !String::from_utf8_lossy(&o.stdout)
            .lines()
            .any(|l| l == "wasm32-wasip2")
    {
        run(Command::new("rustup").args(["target", "add", "wasm32-wasip2"]))?;
    }
    let manifest = dir.join("Cargo.toml");
    run(Command::new("cargo")
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(&manifest))?;
    let text = std::fs::read_to_string(&manifest)?;
    let crate_name = toml::from_str::<toml::Table>(&text)?
        .get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .context("Cargo.toml has no package.name")?
        .replace('-', "_");
    let metadata = Command::new("cargo")
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(&manifest)
        .output()
        .context("failed to run cargo metadata")?;
    let metadata: serde_json::Value =
        serde_json::from_slice(&metadata.stdout).context("cargo metadata did not answer JSON")?;
    let target = metadata["target_directory"]
        .as_str()
        .context("cargo metadata names no target directory")?;
    let built = Path::new(target).join(format!("wasm32-wasip2/release/{crate_name}.wasm"));
    std::fs::copy(&built, out).with_context(|| format!("failed to copy {}", built.display()))?;
    Ok(())
}

fn build_c(dir: &Path) -> anyhow::Result<()> {
    if Command::new("clang-14").arg("--version").output().is_err() {
        let packages: Vec<&str> = C_APT_PACKAGES.split_whitespace().collect();
        bail!(
            "clang-14 is not installed; the C toolchain is Debian's: apt-get install {}",
            packages.join(" ")
        );
    }
    let py = python_tools()?; // wasm-tools comes with the Python toolchain
    let core = dir.join("target/core.wasm");
    std::fs::create_dir_all(dir.join("target"))?;
    run(Command::new("clang-14")
        .args([
            "--target=wasm32-wasi",
            "--sysroot=/usr",
            "-mexec-model=reactor",
        ])
        .args([
            "-fuse-ld=/usr/bin/wasm-ld-14",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Wl,--strip-all",
        ])
        .args([
            "-Ibindings",
            "-Icommon",
            "handler.c",
            "common/json_fields.c",
        ])
        .args([
            "bindings/handler.c",
            "bindings/handler_component_type.o",
            "-o",
            "target/core.wasm",
        ])
        .current_dir(dir))?;
    run(Command::new(py.join("bin/wasm-tools"))
        .args(["component", "new"])
        .arg(&core)
        .arg("-o")
        .arg(dir.join(OUTPUT)))
}

/// Where the pinned toolchains are installed: `IDEMHOST_TOOLCHAIN_DIR`, else
/// `$XDG_CACHE_HOME/idemhost/toolchain`, else `~/.cache/idemhost/toolchain`. Its `py/` has the
/// layout of this repository's `.cache/toolchain/py`, so pointing the variable there reuses
/// what `scripts/build-plugins.sh` installed.
pub(crate) fn toolchain_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("IDEMHOST_TOOLCHAIN_DIR").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither IDEMHOST_TOOLCHAIN_DIR, XDG_CACHE_HOME nor HOME is set")?;
    Ok(cache.join("idemhost/toolchain"))
}

/// `sha256sum`'s line for `text` on stdin: the stamp format the build script writes.
fn stamp(text: &str) -> String {
    format!("{:x}  -\n", sha2::Sha256::digest(text.as_bytes()))
}

fn stamped(path: &Path, text: &str) -> bool {
    std::fs::read_to_string(path).is_ok_and(|s| s == stamp(text))
}

/// The Python toolchain (componentize-py, wasm-tools) at the pinned versions, with hashes.
fn python_tools() -> anyhow::Result<PathBuf> {
    let py = toolchain_dir()?.join("py");
    let marker = py.join(".requirements.sha256");
    if !stamped(&marker, PY_REQUIREMENTS) {
        eprintln!("== installing the Python toolchain into {}", py.display());
        // Replaced only when it is a virtual environment (ours, out of date): a directory of
        // the same name that is something else is not deleted.
        if py.exists() {
            if !py.join("pyvenv.cfg").is_file() {
                bail!(
                    "{} exists and is not a Python virtual environment: set IDEMHOST_TOOLCHAIN_DIR elsewhere",
                    py.display()
                );
            }
            std::fs::remove_dir_all(&py)?;
        }
        run(Command::new("python3").args(["-m", "venv"]).arg(&py))?;
        let req = py.join("requirements.txt");
        std::fs::write(&req, PY_REQUIREMENTS)?;
        run(Command::new(py.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--require-hashes",
                "-r",
            ])
            .arg(&req))?;
        std::fs::write(&marker, stamp(PY_REQUIREMENTS))?;
    }
    Ok(py)
}

/// The JavaScript toolchain (componentize-js) as the lock file pins it.
fn js_tools() -> anyhow::Result<PathBuf> {
    let js = toolchain_dir()?.join("js");
    let marker = js.join("node_modules/.lock.sha256");
    if !stamped(&marker, JS_LOCK) {
        eprintln!(
            "== installing the JavaScript toolchain into {}",
            js.display()
        );
        // `npm ci` replaces node_modules: only in a directory that is empty or ours.
        let ours = js.join("package.json").is_file()
            || std::fs::read_dir(&js).map_or(true, |mut d| d.next().is_none());
        if !ours {
            bail!(
                "{} exists and is not an idemhost toolchain: set IDEMHOST_TOOLCHAIN_DIR elsewhere",
                js.display()
            );
        }
        std::fs::create_dir_all(&js)?;
        std::fs::write(js.join("package.json"), JS_PACKAGE)?;
        std::fs::write(js.join("package-lock.json"), JS_LOCK)?;
        // From npm's cache when it holds the pinned packages (as after scripts/build-plugins.sh,
        // which installs the same lock): no network needed then.
        run(Command::new("npm")
            .args([
                "ci",
                "--prefer-offline",
                "--silent",
                "--no-audit",
                "--no-fund",
            ])
            .current_dir(&js))?;
        std::fs::write(&marker, stamp(JS_LOCK))?;
    }
    Ok(js)
}

/// Runs a build step; its output goes to the terminal, a failure names the program.
/// Runs one step of a build. The toolchains get no `RUST_BACKTRACE`: componentize-py is a Rust
/// program, and with it set (as a developer's shell often has) a Python syntax error came with
/// 68 lines of Rust backtrace. While [`quietly`] runs, a step's output is kept and shown only
/// when the step fails (its last [`SHOWN_LINES`] lines: the language's own error).
fn run(command: &mut Command) -> anyhow::Result<()> {
    let program = command.get_program().to_string_lossy().into_owned();
    run_named(command, &program)
}

/// [`run`], naming the step `program` (a step run under another program, such as the tracer
/// of a pinned build, is named for what it runs).
fn run_named(command: &mut Command, program: &str) -> anyhow::Result<()> {
    command
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    if !QUIET.get() {
        let status = command
            .status()
            .with_context(|| format!("failed to run {program}"))?;
        if !status.success() {
            bail!("{program} failed ({status})");
        }
        return Ok(());
    }
    let output = command
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("failed to run {program}"))?;
    if !output.status.success() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let shown = &lines[lines.len().saturating_sub(SHOWN_LINES)..];
        bail!(
            "{program} failed ({}):\n{}",
            output.status,
            shown.join("\n")
        );
    }
    Ok(())
}

/// The lines of a failed step's output [`run`] shows while [`quietly`] runs.
const SHOWN_LINES: usize = 40;

thread_local! {
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (a build, on this thread) with each step's output kept, shown only if it fails.
pub fn quietly<T>(f: impl FnOnce() -> T) -> T {
    QUIET.set(true);
    let result = f();
    QUIET.set(false);
    result
}
