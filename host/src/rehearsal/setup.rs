//! What a rehearsal set up besides its delivery, and taking it back: the host's migrations of a
//! schema that had none (its tables and functions, or the schema itself when the rehearsal
//! created it) and the consumer's role when it did not exist. The delivery rolls back; with
//! this, a `plugin test` leaves the server as it found it unless asked to keep the set-up.
//!
//! Nobody else may have started using what is taken back: the rehearsal holds the hosts'
//! migrations lock from before its migrations to the end of the undo (a host starting on the
//! schema meanwhile, or another `plugin test`, waits for it), and the undo keeps what shows
//! use all the same — host tables holding rows (a host run with `--no-migrate`), a role with
//! sessions. It drops only what the host's migrations name, without CASCADE: an object of
//! someone else's that depends on them keeps them. Whatever cannot be taken back is reported
//! as kept; the rehearsal's own result stands either way.

use sqlx::{Connection as _, PgConnection, PgPool};
use std::collections::HashSet;

use crate::pg::{self, wall::quote_ident};

/// The server as the rehearsal found it.
pub(super) struct Before {
    schema: String,
    schema_existed: bool,
    /// The schema had none of the host's migrations: what they create is the rehearsal's.
    unmigrated: bool,
    relations: Vec<sqlx::postgres::types::Oid>,
    functions: Vec<sqlx::postgres::types::Oid>,
    role: String,
    role_existed: bool,
}

impl Before {
    /// Looks before the set-up. A schema with some of the host's migrations and not all is
    /// refused when `migrate`: what the missing ones change could not be taken back.
    pub(super) async fn look(
        pool: &PgPool,
        schema: Option<&str>,
        role: &str,
        migrate: bool,
    ) -> anyhow::Result<Before> {
        let schema = pg::schema_name(pool, schema).await?;
        let oid: Option<sqlx::postgres::types::Oid> =
            sqlx::query_scalar("SELECT oid FROM pg_namespace WHERE nspname = $1")
                .bind(&schema)
                .fetch_optional(pool)
                .await?;
        let applied: Vec<i64> = match oid {
            None => Vec::new(),
            Some(_) => {
                let table = format!("{}._sqlx_migrations", quote_ident(&schema));
                let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                    .bind(&table)
                    .fetch_one(pool)
                    .await?;
                if exists {
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                        "SELECT version FROM {table} WHERE success"
                    )))
                    .fetch_all(pool)
                    .await?
                } else {
                    Vec::new()
                }
            }
        };
        let applied_set: HashSet<i64> = applied.iter().copied().collect();
        let missing = pg::MIGRATOR
            .iter()
            .filter(|m| !applied_set.contains(&m.version))
            .count();
        if migrate && !applied.is_empty() && missing > 0 {
            anyhow::bail!(
                "schema {schema} lacks {missing} of this host's migrations: `plugin test` would \
                 apply them and could not take them back. Run `idemhost migrate` first, or pass \
                 --keep-setup (or --no-migrate)"
            );
        }
        let (relations, functions) = match oid {
            Some(oid) => (
                sqlx::query_scalar("SELECT oid FROM pg_class WHERE relnamespace = $1")
                    .bind(oid)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar("SELECT oid FROM pg_proc WHERE pronamespace = $1")
                    .bind(oid)
                    .fetch_all(pool)
                    .await?,
            ),
            None => (Vec::new(), Vec::new()),
        };
        let role_existed: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(role)
                .fetch_one(pool)
                .await?;
        Ok(Before {
            schema,
            schema_existed: oid.is_some(),
            unmigrated: migrate && applied.is_empty(),
            relations,
            functions,
            role: role.to_string(),
            role_existed,
        })
    }

    /// Whether the rehearsal's migrations are its own to take back (the schema had none): then
    /// it holds the migrations lock until its undo ends.
    pub(super) fn migrates_for_itself(&self) -> bool {
        self.unmigrated
    }

    /// Takes back what the set-up made, in the transaction of `lock` (the migrations lock the
    /// rehearsal has held since before its migrations), else in one of its own. The
    /// rehearsal's pools are closed by then: no session of the role is its own. Never fails:
    /// what it could not take back is reported as kept, with why.
    pub(super) async fn undo(self, lock: Option<PgConnection>, pool: &PgPool) -> Undone {
        let mut undone = Undone::default();
        let mut conn = match lock {
            Some(conn) => conn,
            None => match PgConnection::connect_with(&pool.connect_options()).await {
                Ok(mut conn) => match sqlx::query("BEGIN").execute(&mut conn).await {
                    Ok(_) => conn,
                    Err(e) => return undone.all_kept(&self, &pg::describe(&e)),
                },
                Err(e) => return undone.all_kept(&self, &pg::describe(&e)),
            },
        };
        // A session of someone else's holding a lock the undo needs must not hang it.
        let bounded = "SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '30s'";
        if let Err(e) = sqlx::raw_sql(bounded).execute(&mut conn).await {
            return undone.all_kept(&self, &pg::describe(&e));
        }
        let s = quote_ident(&self.schema);
        if self.unmigrated {
            match self.host_rows(&mut conn).await {
                Ok(true) => undone.kept.push(format!(
                    "the host's migrations in schema {}: its tables hold rows this run did not \
                     write (a host or another run used them)",
                    self.schema
                )),
                Ok(false) => self.drop_migrations(&mut conn, &s, &mut undone).await,
                Err(e) => undone.kept.push(format!(
                    "the host's migrations in schema {}: {}",
                    self.schema,
                    pg::describe(&e)
                )),
            }
        }
        if !self.role_existed {
            self.drop_role(&mut conn, &mut undone).await;
        }
        if let Err(e) = sqlx::query("COMMIT").execute(&mut conn).await {
            return undone.all_kept(&self, &pg::describe(&e));
        }
        let _ = conn.close().await;
        undone
    }

    /// The host's tables that were not there before the rehearsal: name and qualified name.
    async fn new_host_tables(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Vec<(String, String)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT c.relname::text, c.oid::regclass::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.oid <> ALL($2) \
               AND c.relname = ANY($3)",
        )
        .bind(&self.schema)
        .bind(&self.relations)
        .bind(crate::sql_gate::HOST_RELATIONS)
        .fetch_all(&mut *conn)
        .await
    }

    /// Whether a host table the migrations made holds a row: the rehearsal's own delivery
    /// rolled back, so a row is someone else's.
    async fn host_rows(&self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        // The migrations' own bookkeeping holds rows of the rehearsal's.
        let tables: Vec<String> = self
            .new_host_tables(conn)
            .await?
            .into_iter()
            .filter(|(name, _)| name != "_sqlx_migrations" && name != "idemhost_key")
            .map(|(_, qualified)| qualified)
            .collect();
        for table in tables {
            let used: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT EXISTS (SELECT 1 FROM {table})"
            )))
            .fetch_one(&mut *conn)
            .await?;
            if used {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Drops the relations and functions the migrations made (and the schema, when the
    /// rehearsal made it), each step in a savepoint: what fails is kept.
    async fn drop_migrations(&self, conn: &mut PgConnection, s: &str, undone: &mut Undone) {
        let tables = self.new_host_tables(conn).await;
        let functions: Result<Vec<String>, _> = sqlx::query_scalar(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = $1 AND p.oid <> ALL($2) \
               AND (p.proname LIKE 'idemhost\\_%' OR p.proname = 'outbox_message_notify')",
        )
        .bind(&self.schema)
        .bind(&self.functions)
        .fetch_all(&mut *conn)
        .await;
        let (tables, functions) = match (tables, functions) {
            (Ok(tables), Ok(functions)) => (
                tables
                    .into_iter()
                    .map(|(_, qualified)| qualified)
                    .collect::<Vec<_>>(),
                functions,
            ),
            (Err(e), _) | (_, Err(e)) => {
                undone.kept.push(format!(
                    "the host's migrations in schema {}: {}",
                    self.schema,
                    pg::describe(&e)
                ));
                return;
            }
        };
        let mut statements = Vec::new();
        if !tables.is_empty() {
            statements.push(format!("DROP TABLE {}", tables.join(", ")));
        }
        if !functions.is_empty() {
            statements.push(format!("DROP FUNCTION {}", functions.join(", ")));
        }
        let what = format!(
            "the host's migrations in schema {} ({} tables, {} functions)",
            self.schema,
            tables.len(),
            functions.len()
        );
        match savepoint(conn, &statements).await {
            Ok(()) => undone.removed.push(what),
            Err(why) => {
                undone.kept.push(format!("{what}: {why}"));
                return;
            }
        }
        if !self.schema_existed {
            match savepoint(conn, &[format!("DROP SCHEMA {s}")]).await {
                Ok(()) => undone.removed.push(format!("schema {}", self.schema)),
                Err(why) => undone.kept.push(format!("schema {}: {why}", self.schema)),
            }
        }
    }

    /// Drops the role the rehearsal made, unless a session uses it. The rehearsal's own
    /// sessions were closed just before, but a server process ends a moment after its client
    /// said goodbye: sessions are counted again for up to [`SESSIONS_END_WITHIN`] until none
    /// is left (on a busy machine one was still listed, and the role was kept: CI).
    async fn drop_role(&self, conn: &mut PgConnection, undone: &mut Undone) {
        let waited = std::time::Instant::now();
        let sessions: Result<i64, _> = loop {
            let n = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = $1")
                .bind(&self.role)
                .fetch_one(&mut *conn)
                .await;
            match n {
                Ok(n) if n > 0 && waited.elapsed() < SESSIONS_END_WITHIN => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                n => break n,
            }
        };
        let exists: Result<bool, _> =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(&self.role)
                .fetch_one(&mut *conn)
                .await;
        match (sessions, exists) {
            (Err(e), _) | (_, Err(e)) => {
                undone
                    .kept
                    .push(format!("role {}: {}", self.role, pg::describe(&e)))
            }
            (_, Ok(false)) => {}
            (Ok(0), Ok(true)) => {
                let r = quote_ident(&self.role);
                let drop = [format!("DROP OWNED BY {r}"), format!("DROP ROLE {r}")];
                match savepoint(conn, &drop).await {
                    Ok(()) => undone.removed.push(format!("role {}", self.role)),
                    Err(why) => undone.kept.push(format!("role {}: {why}", self.role)),
                }
            }
            (Ok(n), Ok(true)) => undone.kept.push(format!(
                "role {}: {n} session(s) of it are open (someone else uses it)",
                self.role
            )),
        }
    }
}

/// How long the undo waits for the sessions of the role it made to end (see
/// `Before::drop_role`).
const SESSIONS_END_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// What the undo took back, and what it kept and why.
#[derive(Debug, Default)]
pub(super) struct Undone {
    pub(super) removed: Vec<String>,
    pub(super) kept: Vec<String>,
}

impl Undone {
    /// Nothing could be taken back (`why`): everything the set-up made is kept.
    fn all_kept(mut self, before: &Before, why: &str) -> Undone {
        self.removed.clear();
        if before.unmigrated {
            self.kept.push(format!(
                "the host's migrations in schema {}: {why}",
                before.schema
            ));
        }
        if !before.role_existed {
            self.kept.push(format!("role {}: {why}", before.role));
        }
        self
    }
}

/// Runs `statements` in a savepoint; on an error, rolls back to it and says why.
async fn savepoint(conn: &mut PgConnection, statements: &[String]) -> Result<(), String> {
    let run = async {
        sqlx::query("SAVEPOINT idemhost_undo")
            .execute(&mut *conn)
            .await?;
        for statement in statements {
            sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .execute(&mut *conn)
                .await?;
        }
        sqlx::query("RELEASE SAVEPOINT idemhost_undo")
            .execute(&mut *conn)
            .await
    };
    match run.await {
        Ok(_) => Ok(()),
        Err(e) => {
            let _ = sqlx::query("ROLLBACK TO SAVEPOINT idemhost_undo")
                .execute(&mut *conn)
                .await;
            Err(pg::describe(&e))
        }
    }
}
