//! Which relations a consumer's role may use, asked of the server before a plugin statement
//! naming one is sent. PostgreSQL locks a relation it is given by name while it parses, and a
//! partitioned table's every partition and index while it plans, before it checks the role's
//! privileges: a plugin without any privilege on another application's table of 8,000
//! partitions made its statement take ~16,000 locks, past the server's shared lock table
//! (`max_locks_per_transaction` × connections), and every other session of the server that
//! needed a lock meanwhile failed with 53200 "out of shared memory". A statement naming a
//! relation the role has no privilege on is refused before it reaches the server.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sql_gate::Relation;

/// How long an answer is kept: a grant or revoke made meanwhile is seen within this.
const FRESH_FOR: Duration = Duration::from_secs(60);
/// Answers kept per consumer; when full they are forgotten (a plugin naming endless distinct
/// relations only pays a lookup per statement).
const MAX_KEPT: usize = 4096;

/// Of the relations `$1` (schemas, `NULL` where unqualified) and `$2` (names), the positions
/// (from 1) of those that exist, resolve as the session would resolve them (its search path
/// for an unqualified one) in a schema the role may use, and on which the role has no
/// privilege at all. Reads the catalog without naming, and so without locking, any relation
/// it looks up; a schema the role may not use is left to the statement (refused by name
/// before any lock).
pub(crate) const UNUSABLE_SQL: &str = "\
SELECT r.i FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[])) \
  WITH ORDINALITY AS r (nsp, rel, i), \
LATERAL (SELECT c.oid, c.relnamespace FROM pg_catalog.pg_class c \
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
  LEFT JOIN pg_catalog.unnest(pg_catalog.current_schemas(true)) WITH ORDINALITY AS p (name, ord) \
    ON p.name = n.nspname \
  WHERE c.relname = r.rel AND (r.nsp IS NULL AND p.ord IS NOT NULL OR n.nspname = r.nsp) \
  ORDER BY p.ord LIMIT 1) c \
WHERE pg_catalog.has_schema_privilege(c.relnamespace, 'USAGE') \
  AND NOT pg_catalog.has_table_privilege(c.oid, \
    'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER') \
  AND NOT pg_catalog.has_any_column_privilege(c.oid, 'SELECT, INSERT, UPDATE, REFERENCES') \
ORDER BY r.i";

/// A consumer's answers about relations its plugin named.
#[derive(Default)]
pub(crate) struct RelationGrants {
    answers: Mutex<HashMap<Relation, (bool, Instant)>>,
}

impl RelationGrants {
    /// The relations of `named` to ask the server about (no fresh answer kept), or the first
    /// one known to be unusable.
    pub(crate) fn to_ask(&self, named: &[Relation]) -> Result<Vec<Relation>, Relation> {
        let Ok(answers) = self.answers.lock() else {
            return Ok(named.to_vec());
        };
        let mut ask = Vec::new();
        for relation in named {
            match answers.get(relation) {
                Some((usable, at)) if at.elapsed() < FRESH_FOR => {
                    if !usable {
                        return Err(relation.clone());
                    }
                }
                _ => ask.push(relation.clone()),
            }
        }
        Ok(ask)
    }

    /// Keeps the server's answer about `asked`: `unusable` holds positions from 1.
    pub(crate) fn learn(&self, asked: &[Relation], unusable: &[i64]) {
        let Ok(mut answers) = self.answers.lock() else {
            return;
        };
        if answers.len() + asked.len() > MAX_KEPT {
            answers.clear();
        }
        let now = Instant::now();
        for (i, relation) in asked.iter().enumerate() {
            let usable = !unusable.contains(&(i as i64 + 1));
            answers.insert(relation.clone(), (usable, now));
        }
    }
}

/// The refusal a plugin sees for a statement naming `relation`.
pub(crate) fn refusal(relation: &Relation) -> String {
    format!(
        "statement refused: `{relation}` is a relation this consumer's role has no privilege \
         on (PostgreSQL locks a relation named in a statement, and every partition of a \
         partitioned one, before it checks privileges)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(name: &str) -> Relation {
        Relation {
            schema: None,
            name: name.into(),
        }
    }

    #[test]
    fn answers_are_kept_and_a_refused_relation_is_refused_without_asking() {
        let grants = RelationGrants::default();
        let named = [rel("a"), rel("b"), rel("c")];
        assert_eq!(grants.to_ask(&named), Ok(named.to_vec()));
        grants.learn(&named, &[2]);
        assert_eq!(grants.to_ask(&[rel("a"), rel("c")]), Ok(vec![]));
        assert_eq!(grants.to_ask(&[rel("a"), rel("b")]), Err(rel("b")));
        assert_eq!(grants.to_ask(&[rel("d"), rel("a")]), Ok(vec![rel("d")]));
    }
}
