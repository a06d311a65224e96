//! What a rehearsal set up besides its delivery, and taking it back: the host's migrations of a
//! schema that had none (its tables and functions, or the schema itself when the rehearsal
//! created it) and the consumer's role when it did not exist. The delivery rolls back; with
//! this, a `plugin test` leaves the server as it found it unless asked to keep the set-up.
//! Only what the host's migrations name is dropped (its relations, its `idemhost_*` and
//! `outbox_message_notify` functions): a table someone else made meanwhile stays.

use sqlx::{Connection as _, PgConnection, PgPool};

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
        let schema = match schema {
            Some(s) => s.to_string(),
            None => sqlx::query_scalar::<_, Option<String>>("SELECT current_schema()::text")
                .fetch_one(pool)
                .await?
                .unwrap_or_else(|| "public".into()),
        };
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
        let known = pg::MIGRATOR.iter().count();
        if migrate && !applied.is_empty() && applied.len() < known {
            anyhow::bail!(
                "schema {schema} has {} of this host's {known} migrations: `plugin test` would \
                 apply the others and could not take them back. Run `idemhost migrate` first, \
                 or pass --keep-setup (or --no-migrate)",
                applied.len()
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

    /// Takes back what the set-up made, in one transaction on a connection of its own (the
    /// rehearsal's pools are closed by then: no session of the role is left). Returns what it
    /// removed, for the report.
    pub(super) async fn undo(self, pool: &PgPool) -> anyhow::Result<Vec<String>> {
        let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
        let mut tx = conn.begin().await?;
        let mut undone = Vec::new();
        let s = quote_ident(&self.schema);
        if self.unmigrated && !self.schema_existed {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {s} CASCADE"
            )))
            .execute(&mut *tx)
            .await?;
            undone.push(format!(
                "schema {} (created for the host's migrations)",
                self.schema
            ));
        } else if self.unmigrated {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.oid <> ALL($2) \
                   AND c.relname = ANY($3)",
            )
            .bind(&self.schema)
            .bind(&self.relations)
            .bind(crate::sql_gate::HOST_RELATIONS)
            .fetch_all(&mut *tx)
            .await?;
            for table in &tables {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {table} CASCADE"
                )))
                .execute(&mut *tx)
                .await?;
            }
            let functions: Vec<String> = sqlx::query_scalar(
                "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                 WHERE n.nspname = $1 AND p.oid <> ALL($2) \
                   AND (p.proname LIKE 'idemhost\\_%' OR p.proname = 'outbox_message_notify')",
            )
            .bind(&self.schema)
            .bind(&self.functions)
            .fetch_all(&mut *tx)
            .await?;
            for function in &functions {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP FUNCTION IF EXISTS {function} CASCADE"
                )))
                .execute(&mut *tx)
                .await?;
            }
            undone.push(format!(
                "the host's migrations in schema {} ({} tables, {} functions)",
                self.schema,
                tables.len(),
                functions.len()
            ));
        }
        let exists_now: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(&self.role)
                .fetch_one(&mut *tx)
                .await?;
        if !self.role_existed && exists_now {
            let r = quote_ident(&self.role);
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP OWNED BY {r}")))
                .execute(&mut *tx)
                .await?;
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {r}")))
                .execute(&mut *tx)
                .await?;
            undone.push(format!("role {}", self.role));
        }
        tx.commit().await?;
        let _ = conn.close().await;
        Ok(undone)
    }
}
