//! Reproducible Python and JavaScript plugin builds. componentize-py and componentize-js run the
//! interpreter and keep a snapshot of its memory, and that memory held what the interpreter read
//! of the machine: random bytes, clocks, file times and inode numbers, the build's own paths. So
//! `plugin build` runs them from a copy of the project at a fixed path, under a tracer that pins
//! file status and raw random and clock reads, with a preloaded library that pins the same
//! through libc (and, for node, a module that pins `Math.random`): `cli/repro/`. The random
//! bytes come from the project's seed (`build-seed`), so each project's interpreter has its own
//! string-hash key; the same source and seed build the same bytes.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use sha2::Digest as _;

/// The project's seed file: 16 hex digits. `plugin new` writes it; `plugin build` writes one
/// when it is missing. Keep it with the source: a rebuild needs it to give the same bytes.
pub const SEED_FILE: &str = "build-seed";

/// Set to `1` to build without pinning (where tracing is not allowed): not reproducible.
const UNPINNED: &str = "IDEMHOST_UNPINNED_BUILD";

/// Where a build runs. Fixed, because the path reaches the component (componentize-js keeps its
/// work directory's name); one build at a time holds it (`lock`).
const STAGE_ROOT: &str = "/tmp/idemhost-plugin-build";

#[cfg(pinned_builds)]
const PIN_SO: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pin.so"));
#[cfg(pinned_builds)]
const TRACER: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tracer"));
const PIN_MJS: &str = include_str!("repro/pin.mjs");

/// A new seed: 16 hex digits from the system's random source.
pub fn new_seed() -> anyhow::Result<String> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("failed to read /dev/urandom for a build seed")?;
    Ok(format!("{:016x}\n", u64::from_le_bytes(bytes)))
}

/// The project's seed, written first if the project has none.
fn seed(project: &Path) -> anyhow::Result<String> {
    let path = project.join(SEED_FILE);
    // Never through a link, a FIFO or a device: a checkout's `build-seed` could be one, and the
    // build (often as root in CI) would write or read, without end, what it points to.
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path);
    let text = match opened {
        Ok(file) => {
            if !file.metadata()?.is_file() {
                bail!("{}: not a regular file", path.display());
            }
            let mut text = String::new();
            file.take(64)
                .read_to_string(&mut text)
                .with_context(|| format!("failed to read {}", path.display()))?;
            text
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let seed = new_seed()?;
            // A dangling link is not "not found" to create_new: it fails rather than follow it.
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .and_then(|mut f| f.write_all(seed.as_bytes()))
                .with_context(|| format!("failed to write {}", path.display()))?;
            eprintln!(
                "== wrote {}: keep it with the source (the same source and seed build the same bytes)",
                path.display()
            );
            seed
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("failed to read {} (a link is refused)", path.display()));
        }
    };
    let seed = text.trim();
    if seed.len() != 16 || !seed.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!(
            "{}: expected 16 hex digits (the build's random seed), found {:?}; delete it to get a new one",
            path.display(),
            seed.chars().take(40).collect::<String>()
        );
    }
    Ok(seed.to_ascii_lowercase())
}

/// Builds `project` with the command `step` makes for a directory holding the project (run
/// there, writing `output` into it), and copies the result to the project's `output`. Pinned
/// (from a copy at [`STAGE_ROOT`], traced) unless this platform cannot or [`UNPINNED`] says not
/// to; then in the project, as any other build.
pub fn build(
    project: &Path,
    output: &str,
    node: bool,
    step: impl FnOnce(&Path) -> Command,
    run: impl FnOnce(&mut Command, &str) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if std::env::var(UNPINNED).is_ok_and(|v| v == "1") || !cfg!(pinned_builds) {
        if !cfg!(pinned_builds) {
            eprintln!(
                "== this platform has no pinned builds (x86_64 Linux only): the output is not reproducible"
            );
        }
        let mut step = step(project);
        let program = step.get_program().to_string_lossy().into_owned();
        return run(&mut step, &program);
    }
    let seed = seed(project)?;
    let root = Path::new(STAGE_ROOT);
    prepare_root(root)?;
    let lock = std::fs::File::create(root.join("lock"))
        .with_context(|| format!("failed to create {}/lock", root.display()))?;
    if lock.try_lock().is_err() {
        eprintln!(
            "== waiting for another plugin build ({} is in use)",
            root.display()
        );
        lock.lock().context("failed to lock the build directory")?;
    }
    let tools = tools()?;
    let stage = root.join("project");
    let (tmp, venv) = (root.join("tmp"), root.join("venv"));
    for dir in [&stage, &tmp, &venv] {
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("failed to clear {}", dir.display()))?;
        }
    }
    copy_source(project, &stage, output)?;
    // componentize-py adds a virtual environment's site-packages (else the machine's Python's):
    // the author's, copied in so that its file times are pinned too, or an empty one.
    let site = venv.join("lib/python3/site-packages");
    std::fs::create_dir_all(&site)?;
    std::fs::create_dir_all(&tmp)?;
    if let Some(theirs) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        for lib in std::fs::read_dir(Path::new(&theirs).join("lib"))
            .with_context(|| format!("failed to read VIRTUAL_ENV's lib ({theirs:?})"))?
        {
            let packages = lib?.path().join("site-packages");
            if packages.is_dir() {
                copy_tree(&packages, &site, &[], 0)?;
            }
        }
    }
    let command = step(&stage);
    let mut traced = Command::new(tools.join("tracer"));
    traced
        .arg(command.get_program())
        .args(command.get_args())
        .current_dir(&stage)
        .env("IDEMHOST_BUILD_SEED", &seed)
        .env("PIN_UNDER", format!("{STAGE_ROOT}/"))
        .env("LD_PRELOAD", tools.join("pin.so"))
        .env("TMPDIR", &tmp)
        .env("VIRTUAL_ENV", &venv);
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => traced.env(key, value),
            None => traced.env_remove(key),
        };
    }
    if node {
        traced.env(
            "NODE_OPTIONS",
            format!("--import {}", tools.join("pin.mjs").display()),
        );
    }
    run(&mut traced, &command.get_program().to_string_lossy())?;
    let built = stage.join(output);
    let target = project.join(output);
    // Written under a new name of its own (never through a link planted in the project), then
    // renamed over the output.
    let partial = project.join(format!(".{output}.{}.partial", new_seed()?.trim()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .and_then(|mut file| std::io::copy(&mut std::fs::File::open(&built)?, &mut file))
        .and_then(|_| std::fs::rename(&partial, &target));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written.with_context(|| format!("failed to write the build to {}", target.display()))?;
    Ok(())
}

/// The fixed directory, this user's alone: created with mode 0700, or found so (not a link).
fn prepare_root(root: &Path) -> anyhow::Result<()> {
    match std::fs::create_dir(root) {
        Ok(()) => std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("failed to create {}", root.display())),
    }
    let meta = std::fs::symlink_metadata(root)?;
    // /proc/self belongs to the process's user.
    let uid = std::fs::metadata("/proc/self")?.uid();
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        bail!(
            "{} is not a directory only this user may write (it belongs to uid {}): Python and \
             JavaScript plugins build there, at a fixed path that reaches the component; \
             remove it, or set {UNPINNED}=1 to build without pinning (not reproducible)",
            root.display(),
            meta.uid()
        );
    }
    Ok(())
}

/// The preloaded library, the tracer and node's module, written once per content into the
/// toolchain directory.
fn tools() -> anyhow::Result<PathBuf> {
    #[cfg(pinned_builds)]
    let files: [(&str, &[u8], u32); 3] = [
        ("pin.so", PIN_SO, 0o644),
        ("tracer", TRACER, 0o755),
        ("pin.mjs", PIN_MJS.as_bytes(), 0o644),
    ];
    #[cfg(not(pinned_builds))]
    let files: [(&str, &[u8], u32); 1] = [("pin.mjs", PIN_MJS.as_bytes(), 0o644)];
    let mut digest = sha2::Sha256::new();
    for (_, bytes, _) in &files {
        digest.update(bytes);
    }
    let dir = super::plugin_new::toolchain_dir()?.join(format!(
        "repro-{}",
        &format!("{:x}", digest.finalize())[..16]
    ));
    if !dir.join(".complete").is_file() {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        for (name, bytes, mode) in files {
            let path = dir.join(name);
            std::fs::write(&path, bytes)
                .and_then(|()| {
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                })
                .with_context(|| format!("failed to write {}", path.display()))?;
        }
        std::fs::write(dir.join(".complete"), "")?;
    }
    Ok(dir)
}

/// The project's files, less what a build writes or a tool keeps: hidden entries, `target/`,
/// `__pycache__/`, the editor's Python stubs (`typings/`: componentize-py would bundle them),
/// the seed and the output.
fn copy_source(project: &Path, stage: &Path, output: &str) -> anyhow::Result<()> {
    copy_tree(
        project,
        stage,
        &["target", "__pycache__", "typings", SEED_FILE, output],
        0,
    )
    .with_context(|| {
        format!(
            "failed to copy {} to {}",
            project.display(),
            stage.display()
        )
    })
}

/// Copies `from` into `to`, links followed (the build sees what they point to, as it would in
/// the project) up to 32 directories deep, so that a link to a parent ends.
fn copy_tree(from: &Path, to: &Path, skip: &[&str], depth: usize) -> anyhow::Result<()> {
    if depth > 32 {
        bail!(
            "{}: more than 32 directories deep (a link to a parent?)",
            from.display()
        );
    }
    std::fs::create_dir_all(to)?;
    // In name order: the order files are made in is the order some file systems list them in.
    let mut entries = std::fs::read_dir(from)?.collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        let text = name.to_string_lossy();
        if text.starts_with('.') || skip.contains(&text.as_ref()) {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::metadata(&path)?;
        if meta.is_dir() {
            copy_tree(&path, &to.join(&name), &["__pycache__"], depth + 1)?;
        } else if meta.is_file() {
            std::fs::copy(&path, to.join(&name))?;
        } else {
            // A FIFO or a device would block the copy, or never end it.
            eprintln!(
                "== not copied into the build (not a regular file): {}",
                path.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("idemhost-repro-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A project without a seed gets one, kept: the next build reads the same.
    #[test]
    fn a_missing_seed_is_written_once_and_then_read() {
        let dir = scratch("seed");
        let first = seed(&dir).unwrap();
        assert!(
            first.len() == 16 && first.bytes().all(|b| b.is_ascii_hexdigit()),
            "{first}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(SEED_FILE)).unwrap().trim(),
            first
        );
        assert_eq!(seed(&dir).unwrap(), first);
        assert_ne!(new_seed().unwrap(), new_seed().unwrap());
    }

    /// A `build-seed` that is a link is neither followed to write a new seed where it points
    /// (a dangling one) nor read (one to a device or a FIFO would block or never end).
    #[test]
    fn a_linked_seed_is_refused_and_its_target_untouched() {
        let dir = scratch("linked-seed");
        let victim = dir.join("victim");
        std::os::unix::fs::symlink(&victim, dir.join(SEED_FILE)).unwrap();
        let err = seed(&dir).unwrap_err().to_string();
        assert!(err.contains(SEED_FILE), "{err}");
        assert!(!victim.exists());
        std::fs::remove_file(dir.join(SEED_FILE)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join(SEED_FILE)).unwrap();
        assert!(seed(&dir).is_err());
    }

    /// A seed that is not 16 hex digits is refused, naming the file, not replaced.
    #[test]
    fn a_malformed_seed_is_refused_with_its_file() {
        let dir = scratch("bad-seed");
        for bad in [
            "",
            "0123",
            "0123456789abcdeg",
            "0123456789abcdef0",
            "$(reboot)",
        ] {
            std::fs::write(dir.join(SEED_FILE), bad).unwrap();
            let err = seed(&dir).unwrap_err().to_string();
            assert!(
                err.contains(SEED_FILE) && err.contains("16 hex digits"),
                "{bad:?}: {err}"
            );
            assert_eq!(std::fs::read_to_string(dir.join(SEED_FILE)).unwrap(), bad);
        }
    }

    /// The staged copy holds the sources only: not what a build writes, hidden entries or the
    /// seed (passed to the build by its environment).
    #[test]
    fn the_staged_copy_holds_the_sources_only() {
        let dir = scratch("copy");
        let project = dir.join("p");
        let sources = ["app.py", "lib/util.py", "wit/consumer.wit"];
        let not_sources = [
            "build-seed",
            "plugin.wasm",
            ".plugin.wasm.partial",
            ".git/HEAD",
            "target/x",
            "__pycache__/app.pyc",
            "lib/__pycache__/u.pyc",
            "typings/wit_world/__init__.py",
        ];
        for file in sources.iter().chain(&not_sources) {
            std::fs::create_dir_all(project.join(file).parent().unwrap()).unwrap();
            std::fs::write(project.join(file), file).unwrap();
        }
        // A FIFO would block the copy for ever: left out.
        let fifo =
            std::ffi::CString::new(project.join("pipe").into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        copy_source(&project, &dir.join("stage"), "plugin.wasm").unwrap();
        let mut found = Vec::new();
        let mut pending = vec![dir.join("stage")];
        while let Some(at) = pending.pop() {
            for entry in std::fs::read_dir(&at).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    found.push(path.strip_prefix(dir.join("stage")).unwrap().to_path_buf());
                }
            }
        }
        found.sort();
        let expected: Vec<PathBuf> = sources.iter().map(PathBuf::from).collect();
        assert_eq!(found, expected);
    }

    /// The fixed build directory is used only when it is this user's alone: a link to
    /// elsewhere, or a directory others may write, is refused (another user could swap the
    /// sources or the output under the build).
    #[test]
    fn a_build_directory_others_could_write_is_refused() {
        let dir = scratch("root");
        let fresh = dir.join("fresh");
        prepare_root(&fresh).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        prepare_root(&fresh).unwrap();
        let open = dir.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        for refused in [open, link] {
            let err = prepare_root(&refused).unwrap_err().to_string();
            assert!(
                err.contains("only this user may write"),
                "{}: {err}",
                refused.display()
            );
        }
    }

    /// Runs `python3 -c script` with the preloaded library and `seed`; its output, or None if
    /// it had not ended after 20 s (then killed).
    #[cfg(pinned_builds)]
    fn pinned_python(script: &str, seed: &str) -> Option<String> {
        let tools = tools().unwrap();
        let mut child = Command::new("python3")
            .args(["-c", script])
            .env("LD_PRELOAD", tools.join("pin.so"))
            .env("IDEMHOST_BUILD_SEED", seed)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > std::time::Duration::from_secs(20) {
                child.kill().unwrap();
                child.wait().unwrap();
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        Some(out)
    }

    /// Under the preloaded library, random bytes follow the seed (the same seed, the same
    /// bytes; another seed, others; two calls, two blocks), the wall clock starts at 2001, and
    /// an absolute sleep or a timed wait still ends (a monotonic start above the real clock
    /// made both last for years).
    #[cfg(pinned_builds)]
    #[test]
    fn pinned_random_follows_the_seed_and_waits_end() {
        let script = "import os, time, threading\n\
                      print(os.urandom(8).hex(), os.urandom(8).hex(), int(time.time()))\n\
                      time.sleep(0.2)\n\
                      c = threading.Condition()\n\
                      with c: print(c.wait(timeout=0.2))";
        let a = pinned_python(script, "0123456789abcdef").expect("a sleep or a wait never ended");
        let b = pinned_python(script, "0123456789abcdef").expect("a sleep or a wait never ended");
        let other = pinned_python(script, "fedcba9876543210").expect("never ended");
        let words: Vec<&str> = a.split_whitespace().collect();
        assert_eq!(words.len(), 4, "{a}");
        assert_ne!(words[0], words[1], "two calls gave the same bytes: {a}");
        assert_eq!(words[2], "978307200", "{a}");
        assert_eq!(words[3], "False", "{a}");
        assert_eq!(a, b);
        assert_ne!(a.split_whitespace().next(), other.split_whitespace().next());
    }
}
