//! Where a plugin's statement is parsed: threads of the gate's own with a stack known to hold
//! the deepest tree a statement of [`super::MAX_SQL_BYTES`] can produce.
//!
//! libpg_query checks no stack depth, and both its grammar actions and its output writer
//! recurse once per tree level: `SELECT 1+1+…` of 16 KB overflowed the 2 MiB stack of the
//! wasmtime fiber the plugin's call runs on and aborted the host. Here the parse, the tree's
//! decoding and the gate's walk all run on [`PARSER_STACK`]-byte stacks, sized from the
//! deepest shapes measured at the length bound (`tests/system/availability.rs` sweeps them); the
//! pages are only committed as deep a parse reaches.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// Stack of each parser thread. The deepest statement of 64 KiB measured here (32,000
/// `+1` terms, tree depth 32,000) needs about 12 MiB; the rest is margin.
pub(crate) const PARSER_STACK: usize = 64 << 20;
/// Parser threads: two, so one plugin sending distinct statements endlessly delays another's
/// first sight of a statement by at most one parse, not a queue of them.
const PARSER_THREADS: usize = 2;

use super::Verdict;

/// Where a verdict goes: an async caller's oneshot, or a blocking caller's channel.
#[cfg_attr(not(any(test, feature = "test-support")), allow(dead_code))]
enum Reply {
    Async(tokio::sync::oneshot::Sender<Verdict>),
    Blocking(mpsc::SyncSender<Verdict>),
}

struct Job {
    sql: String,
    reply: Reply,
}

/// The queue the parser threads take jobs from, started on first use.
fn queue() -> Option<&'static mpsc::Sender<Job>> {
    static QUEUE: OnceLock<Option<mpsc::Sender<Job>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let mut started = 0;
            for n in 0..PARSER_THREADS {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("idemhost-sql-gate-{n}"))
                    .stack_size(PARSER_STACK)
                    .spawn(move || serve(&rx));
                if spawned.is_ok() {
                    started += 1;
                }
            }
            (started > 0).then_some(tx)
        })
        .as_ref()
}

fn serve(rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let verdict = super::judge(&job.sql);
        match job.reply {
            Reply::Async(tx) => {
                let _ = tx.send(verdict);
            }
            Reply::Blocking(tx) => {
                let _ = tx.send(verdict);
            }
        }
    }
}

const UNAVAILABLE: &str = "statement refused: the host's SQL parser is unavailable";

/// Judges `sql` on a parser thread; the caller's task waits without blocking its thread.
pub(crate) async fn judge(sql: &str) -> Verdict {
    let Some(queue) = queue() else {
        return Err(UNAVAILABLE.into());
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job = Job {
        sql: sql.to_owned(),
        reply: Reply::Async(tx),
    };
    if queue.send(job).is_err() {
        return Err(UNAVAILABLE.into());
    }
    rx.await.unwrap_or_else(|_| Err(UNAVAILABLE.into()))
}

/// [`judge`] for callers outside async code (tests, tools): blocks the calling thread.
#[cfg_attr(not(any(test, feature = "test-support")), allow(dead_code))]
pub(crate) fn judge_blocking(sql: &str) -> Verdict {
    let Some(queue) = queue() else {
        return Err(UNAVAILABLE.into());
    };
    let (tx, rx) = mpsc::sync_channel(1);
    let job = Job {
        sql: sql.to_owned(),
        reply: Reply::Blocking(tx),
    };
    if queue.send(job).is_err() {
        return Err(UNAVAILABLE.into());
    }
    rx.recv().unwrap_or_else(|_| Err(UNAVAILABLE.into()))
}
