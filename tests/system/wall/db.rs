//! The database side of `wall.rs`'s set-ups: the schema, the roles, the probe table.

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::*;

/// What a probe delivery records of the session it runs in.
pub const PROBE_SQL: &str = "INSERT INTO probe \
    SELECT $1, pg_backend_pid(), current_user, session_user, \
        (SELECT s.setting || ' from ' || s.source FROM pg_show_all_settings() AS s WHERE s.name = 'synchronous_commit'), \
        current_setting('search_path'), \
        current_setting('statement_timeout') || ' from ' || \
            (SELECT s.source FROM pg_show_all_settings() AS s WHERE s.name = 'statement_timeout'), \
        current_setting('default_transaction_read_only'), \
        current_setting('transaction_read_only'), current_setting('client_encoding'), \
        current_setting('lock_timeout'), \
        (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
        (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
        (SELECT count(*) FROM pg_listening_channels()), \
        (SELECT count(*) FROM pg_cursors WHERE name <> ''), \
        (SELECT count(*) FROM pg_prepared_statements WHERE from_sql)";

pub const TABLES_SQL: &str = "
    CREATE TABLE probe (label text PRIMARY KEY, pid int, cur_user text, sess_user text,
        synchronous_commit text, search_path text, statement_timeout text,
        default_read_only text, read_only text, client_encoding text, lock_timeout text,
        temp_relations bigint, advisory_locks bigint, listening bigint, cursors bigint,
        prepared bigint);
    CREATE TABLE applied (message_id text NOT NULL);
    CREATE TABLE secret (x integer);
    INSERT INTO secret VALUES (42);
    INSERT INTO inventory VALUES ('sku-w', 1000000, 0), ('sku-h', 1000000, 0);";

/// A `probe` row: label, pid, eight settings and user names, five leftover counts.
pub type ProbeRow = (
    String,
    i32,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    i64,
    i64,
);

/// How the host and the plugin's role are set up.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum SetUp {
    /// No `consumer.role`; the host connects as a superuser and provisions the role.
    Default,
    /// The host logs in as a non-superuser owning its schema; an administrator made the role.
    Hardened,
    /// The default with the SQL gate off.
    Ungated,
}

/// The database side of one set-up.
pub struct Db {
    pub schema: String,
    /// The host's role (for the hardened set-up) and its pool; root's otherwise.
    pub host_user: String,
    pub pool: PgPool,
    pub admin: PgPool,
    /// Roles to drop at the end.
    pub roles: Vec<String>,
    /// `consumer.role` lines for the two consumers (hardened only).
    pub role_lines: [String; 2],
}

pub async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(&PG_URL)
        .await
        .unwrap()
}

pub async fn run(admin: &PgPool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

impl Db {
    pub async fn new(setup: SetUp) -> Db {
        init_logs();
        let tag = unique("wall");
        let schema = format!("t_{tag}");
        let admin = admin_pool().await;
        let (host_user, roles, role_lines) = if setup == SetUp::Hardened {
            let host = format!("h_{tag}");
            let plugin = format!("p_{tag}");
            let healthy = format!("q_{tag}");
            for sql in [
                format!("CREATE ROLE {host} LOGIN NOSUPERUSER"),
                format!("CREATE SCHEMA {schema} AUTHORIZATION {host}"),
                format!("CREATE ROLE {plugin} LOGIN NOINHERIT"),
                format!("CREATE ROLE {healthy} LOGIN NOINHERIT"),
                // The host may then stop their statements at the deadline.
                format!("GRANT {plugin}, {healthy} TO {host}"),
            ] {
                run(&admin, &sql).await;
            }
            let lines = [
                format!("role = \"{plugin}\"\n"),
                format!("role = \"{healthy}\"\n"),
            ];
            (host.clone(), vec![plugin, healthy, host], lines)
        } else {
            run(&admin, &format!("CREATE SCHEMA {schema}")).await;
            (
                "root".to_string(),
                Vec::new(),
                [String::new(), String::new()],
            )
        };
        let url = pg_url_as(&host_user);
        let pool = schema_pool(&url, &schema, 4).await;
        run(&pool, TABLES_SQL).await;
        Db {
            schema,
            host_user,
            pool,
            admin,
            roles,
            role_lines,
        }
    }

    pub fn postgres_toml(&self) -> String {
        format!(
            "[postgres]\nurl = \"{}\"\nschema = \"{}\"\nmax_connections = 8\napplication_name = \"{}\"\n",
            pg_url_as(&self.host_user),
            self.schema,
            self.schema
        )
    }

    /// The schema's host key, which signs replayed ids (see `common::replayed`).
    pub async fn host_key(&self) -> String {
        sqlx::query_scalar("SELECT key FROM idemhost_key")
            .fetch_one(&self.admin_in_schema().await)
            .await
            .unwrap()
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&self.admin_in_schema().await)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .unwrap_or(0)
    }

    /// A superuser connection on this schema, for the checks (whatever the host's role).
    pub async fn admin_in_schema(&self) -> PgPool {
        let options =
            idemhost::test_support::pg::connect_options(&PG_URL, Some(&self.schema), "wall-check")
                .unwrap();
        PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap()
    }

    pub async fn cleanup(self) {
        self.pool.close().await;
        run(&self.admin, &format!("DROP SCHEMA {} CASCADE", self.schema)).await;
        let mut roles = self.roles;
        let provisioned: Vec<String> =
            sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")
                .bind(format!("idemhost_{}_", self.schema))
                .fetch_all(&self.admin)
                .await
                .unwrap();
        roles.extend(provisioned);
        for role in roles {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""
            )))
            .execute(&self.admin)
            .await;
        }
    }
}
