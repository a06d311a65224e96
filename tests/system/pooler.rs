//! A connection pooler between the host and PostgreSQL: a real PgBouncer (session mode) in
//! front of the test's server. The host's sessions carry settings given at login — its own the
//! schema's `search_path`, a plugin role's also `statement_timeout` and `synchronous_commit` —
//! which PgBouncer either refuses (`unsupported startup parameter: options`) or, told to ignore
//! them, drops without a word: the host would then migrate and claim on the wrong search path,
//! and run plugins without their timeout. The host names the first and refuses the second.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A PgBouncer of the test's own, in session mode, letting in `users` (trust: no password asked;
/// it logs in to the server with the password listed), ignoring the startup parameters
/// `ignore`.
struct Bouncer {
    child: Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl Bouncer {
    fn start(ignore: &str, users: &[(&str, &str)]) -> Bouncer {
        let pg = url::Url::parse(&PG_URL).unwrap();
        let dir = std::env::temp_dir().join(unique("idemhost_pgbouncer"));
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let auth: String = users
            .iter()
            .map(|(u, p)| format!("\"{u}\" \"{p}\"\n"))
            .collect();
        std::fs::write(dir.join("users.txt"), auth).unwrap();
        let ini = format!(
            "[databases]\n* = host={} port={}\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
             listen_port = {port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
             pool_mode = session\nignore_startup_parameters = {ignore}\n",
            pg.host_str().unwrap(),
            pg.port().unwrap_or(5432),
            dir.join("users.txt").display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect(
                "pgbouncer is installed (scripts/test.sh installs it: apt-get install pgbouncer)",
            );
        // PgBouncer refuses to run as root: then as nobody, the files readable by all.
        let mut cmd = if unsafe { libc::geteuid() } == 0 {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", binary]);
            c
        } else {
            Command::new(binary)
        };
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("pgbouncer.log")).unwrap())
            .spawn()
            .unwrap();
        let bouncer = Bouncer { child, dir, port };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "pgbouncer did not listen: {}",
                std::fs::read_to_string(bouncer.dir.join("pgbouncer.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        bouncer
    }

    /// The test's `postgres.url` with PgBouncer in place of the server.
    fn url(&self) -> String {
        let mut url = url::Url::parse(&PG_URL).unwrap();
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.to_string()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Through PgBouncer: without `options` in its ignore list the host's start fails with the
/// server's refusal and a pooler named as the likely cause; with it, the host's own pool is
/// refused because the schema's `search_path` did not arrive, and a plugin role's pool because
/// its `statement_timeout` and `synchronous_commit` did not. The same role pool straight to
/// PostgreSQL opens.
#[tokio::test]
async fn a_pooler_that_refuses_or_drops_the_login_settings_is_named() {
    let env = TestEnv::new("pooler").await;
    let nats = NatsEnv::new("pooler", Duration::from_secs(60)).await;
    let role = env.schema.clone();
    // The servers scripts/test-servers.sh starts ask for passwords.
    const PASSWORD: &str = "pooled-pw";
    env.execute(&format!("CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'"))
        .await;
    let pg = url::Url::parse(&PG_URL).unwrap();
    let user = pg.username().to_string();
    let user_password = pg.password().unwrap_or("").to_string();
    let users = [
        (user.as_str(), user_password.as_str()),
        (role.as_str(), PASSWORD),
    ];
    // Each refusal is retried until the pool's acquire_timeout.
    let text = config_text(&env, &nats, "pooled-v1", "testkit", "").replace(
        "max_connections = 8",
        "max_connections = 8\nacquire_timeout = \"1s\"",
    );

    let refusing = Bouncer::start("extra_float_digits", &users);
    let err = start_error(parse_config(&text.replace(&*PG_URL, &refusing.url()))).await;
    assert!(
        err.contains("unsupported startup parameter") && err.contains("connection pooler"),
        "{err}"
    );
    drop(refusing);

    let dropping = Bouncer::start("extra_float_digits,options", &users);
    let err = start_error(parse_config(&text.replace(&*PG_URL, &dropping.url()))).await;
    assert!(
        err.contains("did not apply the settings") && err.contains("(search_path)"),
        "{err}"
    );
    // A plugin role's pool, its login settings dropped (no schema: the host's own pool would
    // have nothing to lose).
    let login = [
        ("synchronous_commit", "on".to_string()),
        ("statement_timeout", "5000".to_string()),
    ];
    let role_pool = |url: String| {
        let mut config = parse_config(&text);
        config.postgres.url = url;
        config.postgres.schema = None;
        let (role, login) = (role.clone(), login.clone());
        async move {
            let failover = idemhost::test_support::pg::Failover::find(&config.postgres)
                .await
                .unwrap();
            let pool = idemhost::test_support::pg::wall::role_pool(
                &config.postgres,
                &failover,
                &role,
                Some(PASSWORD),
                1,
                &login,
            )
            .await;
            failover.close_all().await;
            pool.map(|_| ()).map_err(|e| format!("{e:#}"))
        }
    };
    let err = role_pool(dropping.url()).await.unwrap_err();
    assert!(
        err.contains("did not apply the settings")
            && err.contains("(synchronous_commit, statement_timeout)"),
        "{err}"
    );
    role_pool(PG_URL.to_string()).await.unwrap();
    drop(dropping);
    env.execute(&format!("DROP ROLE {role}")).await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A connection whose login carried another client's settings (what a pooler sharing server
/// connections opened with the first client's `options` would hand out) is refused too: the
/// check compares each value, not only where it came from.
#[tokio::test]
async fn a_connection_with_another_clients_login_settings_is_refused() {
    let env = TestEnv::new("pooler_value").await;
    let options = idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), "t")
        .unwrap()
        .options([("statement_timeout", "7000")]);
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect_with(&options)
        .await
        .unwrap();
    let check = idemhost::test_support::pg::check_login_settings;
    let ours = |timeout: &str| {
        vec![
            ("search_path", env.schema.clone()),
            ("statement_timeout", timeout.to_string()),
        ]
    };
    check(&mut conn, &ours("7000")).await.unwrap();
    let err = check(&mut conn, &ours("5000"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("(statement_timeout)"), "{err}");
    let other = vec![("search_path", "public".to_string())];
    let err = check(&mut conn, &other).await.unwrap_err().to_string();
    assert!(err.contains("(search_path)"), "{err}");
    drop(conn);
    env.cleanup().await;
}
