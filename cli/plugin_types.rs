//! Editor types for Python and JavaScript plugin projects: the world's bindings as Python stubs
//! in `typings/` (componentize-py's, where pyright looks by default; `mypy.ini` points mypy
//! there) and TypeScript declarations in `types/` (jco's guest types; `jsconfig.json` makes
//! `tsc` check the handler against them), written by `plugin new` and kept current by every
//! `plugin build`. A file is rewritten only when its content changes, so an editor (or `plugin
//! dev`'s watch) sees no change when the WIT did not change.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;

use super::plugin_new::Lang;

/// Where the stubs go, by language.
pub const PYTHON_STUBS: &str = "typings";
pub const JS_DECLARATIONS: &str = "types";

/// mypy's configuration in a Python project: the stubs' directory.
pub const MYPY_INI: &str = "[mypy]\nmypy_path = typings\nfiles = app.py\n";

/// `tsc -p jsconfig.json` (and an editor) checks the handler against the declarations.
pub const JSCONFIG: &str = r#"{
  "compilerOptions": {
    "checkJs": true,
    "strict": true,
    "noEmit": true,
    "target": "es2022",
    "module": "es2022",
    "moduleResolution": "bundler",
    "lib": ["es2022", "dom"]
  },
  "include": ["handler.js", "types/**/*.d.ts"]
}
"#;

/// jco's type generator reads the WIT through a WASI shim that, in the pinned version, starts
/// with no directory open; this module, loaded first, opens `/` for it.
const JCO_PREOPEN: &str = "import { _addPreopen } from \
    '../node_modules/@bytecodealliance/jco-transpile/node_modules/@bytecodealliance/preview2-shim/dist/nodejs/filesystem.js';\n\
    _addPreopen('/', '/');\n";

/// Writes (or brings up to date) the project's editor types. `run` runs a toolchain step.
pub fn write(
    dir: &Path,
    lang: Lang,
    python: impl FnOnce() -> anyhow::Result<std::path::PathBuf>,
    js: impl FnOnce() -> anyhow::Result<std::path::PathBuf>,
    run: impl FnOnce(&mut Command) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let fresh = std::env::temp_dir().join(format!(
        "idemhost-types-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let target = match lang {
        Lang::Python => {
            run(Command::new(python()?.join("bin/componentize-py"))
                .args(["-d", "wit", "-w", "handler", "bindings"])
                .arg(&fresh)
                .current_dir(dir))?;
            PYTHON_STUBS
        }
        Lang::Js => {
            let tools = js()?;
            let preopen = tools.join("idemhost/preopen.mjs");
            if std::fs::read_to_string(&preopen).ok().as_deref() != Some(JCO_PREOPEN) {
                std::fs::create_dir_all(tools.join("idemhost"))?;
                std::fs::write(&preopen, JCO_PREOPEN)
                    .with_context(|| format!("failed to write {}", preopen.display()))?;
            }
            run(Command::new(tools.join("node_modules/.bin/jco"))
                .args([
                    "guest-types",
                    "wit",
                    "--world-name",
                    "handler",
                    "--quiet",
                    "-o",
                ])
                .arg(&fresh)
                .env("NODE_OPTIONS", format!("--import {}", preopen.display()))
                .current_dir(dir))?;
            JS_DECLARATIONS
        }
        Lang::Rust | Lang::C => return Ok(()),
    };
    let synced = sync(&fresh, &dir.join(target));
    let _ = std::fs::remove_dir_all(&fresh);
    synced.with_context(|| format!("failed to write {}", dir.join(target).display()))
}

/// Copies `from` into `to`, writing only files whose content differs.
fn sync(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            sync(&source, &target)?;
        } else {
            let bytes = std::fs::read(&source)?;
            if std::fs::read(&target).ok().as_ref() != Some(&bytes) {
                std::fs::write(&target, bytes)?;
            }
        }
    }
    Ok(())
}
