//! `idemhost plugin dev`: the author's loop in one command. Watches a plugin project, builds it
//! on every change (`plugin build`, each step's output shown only when it fails: the language's
//! own error), and runs its sample messages through the new component as `plugin test` does,
//! rolled back, printing a few lines per sample.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use clap::Args;

use super::plugin_new::{self, OUTPUT};
use super::plugin_test::{self, TestArgs};

/// What `plugin dev` watches and runs.
#[derive(Debug, Args)]
pub struct DevArgs {
    /// The project (default: the current directory).
    #[arg(default_value = ".")]
    dir: PathBuf,
    /// A sample message's payload (repeatable). Default: the project's `sample*.json`.
    #[arg(long = "payload")]
    payloads: Vec<PathBuf>,
    /// The `Idemhost-Event-Type` header of every sample.
    #[arg(long)]
    event_type: Option<String>,
    /// The host's config the samples run under (as `plugin test --config`). Default: the
    /// project's `idemhost.toml` when there is one.
    #[arg(long, env = "IDEMHOST_CONFIG")]
    config: Option<PathBuf>,
    /// Which configured consumer to run as (needed when the config has several).
    #[arg(long)]
    consumer: Option<String>,
    /// Build and run the samples once, then exit: 0 when every sample applied, 1 when the
    /// build failed, else the first other sample's `plugin test` status.
    #[arg(long)]
    once: bool,
    /// How often the project's files are looked at.
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    poll: Duration,
}

/// Runs `plugin dev`: until interrupted, or one round with `--once` (its exit status).
pub async fn dev(args: DevArgs) -> anyhow::Result<u8> {
    let dir = args.dir.clone();
    anyhow::ensure!(
        dir.is_dir(),
        "{}: not a directory (the plugin project to watch)",
        dir.display()
    );
    let samples = samples(&args)?;
    let config = args.config.clone().or_else(|| {
        let own = dir.join("idemhost.toml");
        own.is_file().then_some(own)
    });
    let mut seen = None;
    loop {
        let now = fingerprint(&dir)?;
        if seen.as_ref() != Some(&now) {
            // Kept from before the round: a file saved while it runs starts the next one.
            seen = Some(now);
            let code = round(&args, &dir, &samples, config.as_ref()).await;
            if args.once {
                return Ok(code);
            }
            println!("-- watching {} (Ctrl-C stops)", dir.display());
        }
        tokio::select! {
            () = tokio::time::sleep(args.poll) => {}
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
}

/// The samples to run: the ones given, else the project's `sample*.json`.
fn samples(args: &DevArgs) -> anyhow::Result<Vec<PathBuf>> {
    if !args.payloads.is_empty() {
        return Ok(args.payloads.clone());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&args.dir)
        .with_context(|| format!("failed to read {}", args.dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("sample") && n.ends_with(".json"))
        })
        .collect();
    found.sort();
    anyhow::ensure!(
        !found.is_empty(),
        "{}: no sample*.json to run; give --payload FILE",
        args.dir.display()
    );
    Ok(found)
}

/// One build and run of every sample; the round's exit status (see [`DevArgs::once`]).
async fn round(args: &DevArgs, dir: &Path, samples: &[PathBuf], config: Option<&PathBuf>) -> u8 {
    let started = Instant::now();
    let project = dir.to_path_buf();
    let built =
        tokio::task::spawn_blocking(move || plugin_new::quietly(|| plugin_new::build(&project)))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r);
    let out = match built {
        Ok(out) => out,
        Err(e) => {
            println!("build failed ({}):\n{e:#}", secs(started.elapsed()));
            return 1;
        }
    };
    println!("built {} in {}", out.display(), secs(started.elapsed()));
    let mut code = 0;
    for sample in samples {
        let test = TestArgs::sample(
            dir.join(OUTPUT),
            sample,
            args.event_type.clone(),
            config.cloned(),
            args.consumer.clone(),
        );
        let name = sample.file_name().map_or_else(
            || sample.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match plugin_test::summary(&test).await {
            Ok((status, shown)) => {
                print!("{name}: {shown}");
                if code == 0 {
                    code = status;
                }
            }
            Err(e) => {
                println!("{name}: could not run: {e:#}");
                if code == 0 {
                    code = 1;
                }
            }
        }
    }
    code
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Directories a build writes or a toolchain keeps (the editor types among them), never the
/// author's sources.
const NOT_SOURCES: &[&str] = &[
    "target",
    "node_modules",
    "__pycache__",
    ".cache",
    ".git",
    "typings",
    "types",
];
/// Files looked at, at most (a project is a handful; a tree this large is not one).
const MAX_FILES: usize = 10_000;

/// The project's source files, each with its size and modification time, in order.
fn fingerprint(dir: &Path) -> anyhow::Result<Vec<(PathBuf, u64, SystemTime)>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(at) = pending.pop() {
        let entries =
            std::fs::read_dir(&at).with_context(|| format!("failed to read {}", at.display()))?;
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                if !NOT_SOURCES.contains(&name.as_ref()) {
                    pending.push(entry.path());
                }
            } else if name != OUTPUT && !name.starts_with('.') {
                // (A build's `.plugin.wasm.partial` is hidden: not a change to build again.)
                let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                files.push((entry.path(), meta.len(), modified));
                anyhow::ensure!(
                    files.len() <= MAX_FILES,
                    "{}: more than {MAX_FILES} files; not a plugin project to watch",
                    dir.display()
                );
            }
        }
    }
    files.sort();
    Ok(files)
}
