//! Private servers for the tests that stop, pause or fail them (the machine's shared ones stay
//! up): a `nats-server`, a PostgreSQL cluster (and its standby), a JetStream cluster.

use std::path::PathBuf;

use super::*;

/// A private `nats-server` with JetStream on a free port and its own store directory, for
/// tests that stop the server: the machine's shared NATS stays up. Killed when dropped.
pub struct PrivateNats {
    port: u16,
    dir: PathBuf,
    child: Option<std::process::Child>,
    /// A configuration file (`-c`), when started with one.
    config: Option<PathBuf>,
}

impl PrivateNats {
    pub fn start() -> PrivateNats {
        let port = free_port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("nats-store"));
        let mut server = PrivateNats {
            port,
            dir,
            child: None,
            config: None,
        };
        server.restart();
        server
    }

    /// [`Self::start`] with `config` (nats-server's configuration syntax: users, permissions)
    /// as its configuration file.
    pub fn start_with(config: &str) -> PrivateNats {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("nats-store"));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("nats.conf");
        std::fs::write(&file, config).unwrap();
        let mut server = PrivateNats {
            port: free_port(),
            dir,
            child: None,
            config: Some(file),
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store, and waits until it accepts.
    pub fn restart(&mut self) {
        let (log_path, log) = server_log(&self.dir);
        let mut command = std::process::Command::new(NATS_SERVER.get());
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let child = command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(log.try_clone().expect("the log's handle"))
            .spawn()
            .expect("start nats-server");
        let child = self.child.insert(child);
        wait_accepting(self.port, "private nats-server", child, &log_path);
    }

    /// Stops the server gracefully (SIGTERM: it flushes its store) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// Sends `signal` to the server (SIGSTOP / SIGCONT: a stalled server).
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            send_signal(child.id(), signal);
        }
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private PostgreSQL 15 cluster (`initdb` + `pg_ctl` from /usr/lib/postgresql/15/bin, run as
/// `nobody`, trust auth, superuser `idemhost`) on a free port in its own directory, for tests
/// that stop the server: the machine's shared PostgreSQL stays up. Stopped when dropped.
pub struct PrivatePostgres {
    port: u16,
    dir: PathBuf,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("idemhost-pg"));
        std::fs::create_dir_all(&dir).unwrap();
        let pg = PrivatePostgres { port, dir };
        run("chown", &["nobody:nogroup", pg.path("")]);
        as_nobody(
            "initdb",
            &[
                "-D",
                pg.path("data"),
                "-A",
                "trust",
                "-U",
                "idemhost",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started: read-only, in recovery.
    pub fn standby_of(primary: &PrivatePostgres) -> PrivatePostgres {
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("idemhost-pg-standby"));
        std::fs::create_dir_all(&dir).unwrap();
        let pg = PrivatePostgres { port, dir };
        run("chown", &["nobody:nogroup", pg.path("")]);
        let source = primary.port.to_string();
        as_nobody(
            "pg_basebackup",
            &[
                "-D",
                pg.path("data"),
                "-h",
                "127.0.0.1",
                "-p",
                &source,
                "-U",
                "idemhost",
                "-R",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    fn path(&self, name: &str) -> &str {
        // Leaked once per call site and test: a few bytes, and it keeps the call sites plain.
        let p = self.dir.join(name);
        Box::leak(p.to_string_lossy().into_owned().into_boxed_str())
    }

    pub fn url(&self) -> String {
        format!("postgres://idemhost@127.0.0.1:{}/postgres", self.port)
    }

    /// `host:port` of this server, for a host list.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `pg_ctl promote`, waiting until the standby is a primary that accepts writes.
    pub fn promote(&self) {
        as_nobody("pg_ctl", &["-D", self.path("data"), "-w", "promote"]);
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.path("")
        );
        as_nobody(
            "pg_ctl",
            &[
                "-D",
                self.path("data"),
                "-w",
                "-o",
                &options,
                "-l",
                self.path("log"),
                "start",
            ],
        );
    }

    /// `pg_ctl stop -m immediate`: the server dies without a checkpoint, connections drop.
    pub fn stop_immediate(&self) {
        as_nobody(
            "pg_ctl",
            &["-D", self.path("data"), "-w", "-m", "immediate", "stop"],
        );
    }

    /// Sends `signal` to the postmaster and every backend (SIGSTOP / SIGCONT: a stalled server
    /// that neither answers nor closes its connections). The postmaster is stopped before its
    /// backends are listed, so that none it forks meanwhile is left running.
    pub fn signal_all(&self, signal: i32) {
        let pid_file = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap();
        let postmaster = pid_file.lines().next().and_then(server_pid).unwrap();
        send_signal(postmaster, signal);
        let children = std::process::Command::new("pgrep")
            .args(["-P", &postmaster.to_string()])
            .output()
            .unwrap();
        for pid in String::from_utf8_lossy(&children.stdout)
            .lines()
            .filter_map(server_pid)
        {
            send_signal(pid, signal);
        }
    }

    /// `pg_ctl stop -m fast`: open transactions are rolled back, sessions are closed.
    pub fn stop_fast(&self) {
        as_nobody(
            "pg_ctl",
            &["-D", self.path("data"), "-w", "-m", "fast", "stop"],
        );
    }
}

fn run(program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir("/tmp")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs a PostgreSQL tool as `nobody` (initdb refuses root).
fn as_nobody(tool: &str, args: &[&str]) {
    let tool = format!("{PG_BIN}/{tool}");
    let mut all = vec!["-u", "nobody", "--", tool.as_str()];
    all.extend_from_slice(args);
    run("runuser", &all);
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // A test that failed while the server was stopped would leave pg_ctl waiting for a
        // postmaster that never runs again.
        if self.dir.join("data/postmaster.pid").exists()
            && std::panic::catch_unwind(|| self.signal_all(libc::SIGCONT)).is_err()
        {
            eprintln!("could not resume the private PostgreSQL before stopping it");
        }
        let _ = std::process::Command::new("runuser")
            .args(["-u", "nobody", "--", &format!("{PG_BIN}/pg_ctl"), "-D"])
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private JetStream cluster of `nats-server` nodes on loopback (routes between all of them,
/// a store directory each). Nodes are killed when dropped.
pub struct PrivateCluster {
    nodes: Vec<ClusterNode>,
}

struct ClusterNode {
    name: String,
    port: u16,
    route_port: u16,
    dir: PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateCluster {
    /// Starts `n` nodes and waits until each accepts connections.
    pub fn start(n: usize) -> PrivateCluster {
        let tag = unique("cluster");
        let nodes = (0..n)
            .map(|i| ClusterNode {
                name: format!("n{i}"),
                port: free_port(),
                route_port: free_port(),
                dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-n{i}")),
                child: None,
            })
            .collect();
        let mut cluster = PrivateCluster { nodes };
        for i in 0..n {
            cluster.start_node(i);
        }
        cluster
    }

    /// Every node's client URL, comma-separated (what `nats.url` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// (Re)starts node `i` on its ports and store.
    pub fn start_node(&mut self, i: usize) {
        let routes = self
            .nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.route_port))
            .collect::<Vec<_>>()
            .join(",");
        let node = &mut self.nodes[i];
        let (log_path, log) = server_log(&node.dir);
        let child = std::process::Command::new(NATS_SERVER.get())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &node.port.to_string(),
                "-n",
                &node.name,
            ])
            .args(["-js", "--cluster_name", "idemhost-test"])
            .arg("-cluster")
            .arg(format!("nats://127.0.0.1:{}", node.route_port))
            .args(["-routes", &routes, "-sd"])
            .arg(&node.dir)
            .stdout(std::process::Stdio::null())
            .stderr(log.try_clone().expect("the log's handle"))
            .spawn()
            .expect("start nats-server");
        let child = node.child.insert(child);
        wait_accepting(node.port, "cluster node", child, &log_path);
    }

    /// The index of the node called `name` (as stream info names a leader).
    pub fn index_of(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).unwrap()
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` to node `i` (SIGSTOP / SIGCONT: a stalled node).
    pub fn signal(&self, i: usize, signal: i32) {
        if let Some(child) = &self.nodes[i].child {
            send_signal(child.id(), signal);
        }
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.signal(i, libc::SIGCONT);
            self.kill(i);
            let _ = std::fs::remove_dir_all(&self.nodes[i].dir);
        }
    }
}

/// A server's process id as a pid file or `pgrep` prints it: never 0 or 1, which kill(2)
/// would take for this test's process group or init.
fn server_pid(line: &str) -> Option<u32> {
    line.trim().parse::<u32>().ok().filter(|pid| *pid > 1)
}

/// Sends `signal` to process `pid` (one of this test's servers); after SIGSTOP, returns only once
/// every thread of it has stopped.
///
/// kill(2) returns when the signal is queued, not when it took effect: until the thread chosen to
/// take it runs, the process's other threads go on serving. Measured on this 2-core machine under
/// a build: 126 of 300 nats-server processes still had a running thread right after kill, for up
/// to 13 ms — time enough for a "stopped" server to acknowledge the test's next publish.
fn send_signal(pid: u32, signal: i32) {
    let pid_t = i32::try_from(pid).expect("a pid fits pid_t");
    // SAFETY: kill(2) on a process this test started.
    if unsafe { libc::kill(pid_t, signal) } != 0 {
        let e = std::io::Error::last_os_error();
        // A process that exited meanwhile has nothing left to stop or resume.
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ESRCH),
            "kill({pid}, {signal}): {e}"
        );
        return;
    }
    if signal != libc::SIGSTOP {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = running_threads(pid);
        if running.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            // Resumed before failing: a stopped server would hang its own clean-up.
            // SAFETY: as above.
            unsafe { libc::kill(pid_t, libc::SIGCONT) };
            panic!(
                "process {pid} not stopped 10 s after SIGSTOP; its threads' states: {running:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The threads of `pid` that are not stopped, as (thread id, state): empty when each is
/// stopped, or gone (a thread or process that exited cannot answer either).
fn running_threads(pid: u32) -> Vec<(String, char)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            // Gone since the listing: nothing to wait for.
            let stat = std::fs::read(task.path().join("stat")).ok()?;
            // The state is the first field after the command name, which may hold any byte.
            let after_name = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
            let state = after_name
                .iter()
                .copied()
                .find(|b| !b.is_ascii_whitespace())?;
            (!matches!(state, b'T' | b't' | b'Z' | b'X')).then(|| {
                (
                    task.file_name().to_string_lossy().into_owned(),
                    state as char,
                )
            })
        })
        .collect()
}
