//! The library's error as an embedder meets it: `Host::run` and `migrate` return
//! `idemhost::Error`, whose kind says which side failed and whose SQLSTATE is PostgreSQL's
//! answer, without parsing the text.

use std::time::Duration;

use idemhost::{ErrorKind, Host, RunOptions};

use crate::common::*;

/// A port of this machine nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn run(config: idemhost::Config) -> idemhost::Error {
    tokio::time::timeout(
        Duration::from_secs(60),
        Host::new(config).run(RunOptions::default(), std::future::pending()),
    )
    .await
    .expect("the start fails within a minute")
    .expect_err("the host does not start")
}

#[tokio::test]
async fn a_failed_start_says_which_side_failed_and_what_postgresql_answered() {
    let env = TestEnv::new("errkind").await;
    let nats = NatsEnv::new("errkind", Duration::from_secs(60)).await;
    let text = config_text(&env, &nats, "errkind-v1", "inventory", "");

    // PostgreSQL does not answer.
    let pg_url = format!("postgres://root@127.0.0.1:{}/test", closed_port());
    let url_line = text
        .lines()
        .find(|l| l.starts_with("url = \"postgres"))
        .unwrap()
        .to_string();
    let e = run(parse_config(
        &text.replace(&url_line, &format!("url = \"{pg_url}\"")),
    ))
    .await;
    assert_eq!(e.kind(), ErrorKind::Database, "{e:#}");
    assert_eq!(e.sqlstate(), None, "{e:#}");

    // PostgreSQL answers, refusing the database.
    let e = run(parse_config(&text.replace(
        &url_line,
        &url_line.replacen("/test", "/no_such_database_here", 1),
    )))
    .await;
    assert_eq!(e.kind(), ErrorKind::Database, "{e:#}");
    assert_eq!(e.sqlstate().as_deref(), Some("3D000"), "{e:#}");

    // NATS does not answer.
    let nats_line = text
        .lines()
        .find(|l| l.starts_with("url = \"nats"))
        .unwrap()
        .to_string();
    let e = run(parse_config(&text.replace(
        &nats_line,
        &format!(
            "url = \"nats://127.0.0.1:{}\"\nconnect_timeout = \"2s\"",
            closed_port()
        ),
    )))
    .await;
    assert_eq!(e.kind(), ErrorKind::Broker, "{e:#}");

    // The host's migrations on a role that may not create the schema.
    let role = format!("{}_noschema", env.schema);
    env.execute(&format!("CREATE ROLE {role} LOGIN")).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url_as(&role))
        .await
        .unwrap();
    let e = idemhost::migrate(&pool, Some(&format!("{}_other", env.schema)))
        .await
        .expect_err("no privilege to create a schema");
    assert_eq!(e.kind(), ErrorKind::Database, "{e:#}");
    assert_eq!(e.sqlstate().as_deref(), Some("42501"), "{e:#}");
    pool.close().await;
    env.execute(&format!("DROP ROLE {role}")).await;

    nats.cleanup().await;
    env.cleanup().await;
}
