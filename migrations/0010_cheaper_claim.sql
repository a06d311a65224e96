-- What a delivery costs the server, cut without changing what is guaranteed (measured with
-- scripts/bench-wall.sh against the seed's transaction):
--
-- 1. The plugin version row's foreign key to its marker ran a referential-integrity check per
--    row (a `SELECT ... FOR KEY SHARE` of the marker the same function had just inserted), the
--    most expensive part of the claim. Its one use was `ON DELETE CASCADE`: a marker deleted
--    (`markers prune`, an operator's DELETE or TRUNCATE) takes its version row with it. That is
--    now a statement-level trigger per DELETE and per TRUNCATE of `processed_message`, which
--    costs a claim nothing. The claim writes the version row with `ON CONFLICT ... DO UPDATE`,
--    so a row left behind by a marker removed with triggers off (`session_replication_role =
--    replica`) is overwritten, never a failed claim.
-- 2. The host's functions called `idemhost_authorize` (a second SECURITY DEFINER function,
--    with its own `search_path`: a second configuration change and its undo per call). The
--    check is now inline. They keep their fixed `search_path`: what they run runs as their
--    owner, triggers on the tables they write included, and the outbox's trigger function
--    (0005) named `pg_notify` unqualified — without the fixed path, a session that put a schema
--    of its own before `pg_catalog` ran its own `pg_notify` as the host's role (found by review
--    with the SQL gate off). Every name in their bodies, and in that trigger function now, is
--    qualified as well. They still run only for the caller that presents the host key, on a
--    UTF-8 session.
-- 3. The clearing of a plugin's session as each delivery ends (and between two deliveries of a
--    group) was five statements the server parsed and planned for every delivery; it is one
--    call of `idemhost_session_clear` now, whose statements keep their plans in the session.
--    It runs as the caller (it clears the caller's session) and only does what the host sent
--    before: settings back to their defaults, temporary objects dropped, cursors closed, LISTEN
--    undone, session advisory locks released; then the host's settings given set for the rest
--    of the transaction. True when the session holds what it cannot undo: SQL-level prepared
--    statements (the host then closes the connection) or, when asked, a read-only transaction.
DO $migration$
DECLARE
    s text := current_schema();
    fk text;
    -- Each function's first statements (0006's idemhost_authorize, inline): a UTF-8 session,
    -- and the caller presents the host key (compared as digests).
    authorized text := format($check$
            IF pg_catalog.current_setting('client_encoding') OPERATOR(pg_catalog.<>) 'UTF8' THEN
                RAISE EXCEPTION 'idemhost: client_encoding is %%, not UTF8',
                    pg_catalog.current_setting('client_encoding') USING ERRCODE = '55000';
            END IF;
            IF p_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM %1$I.idemhost_key k
                WHERE pg_catalog.sha256(pg_catalog.convert_to(k.key, 'UTF8'))
                    OPERATOR(pg_catalog.=) pg_catalog.sha256(pg_catalog.convert_to(p_key, 'UTF8'))
            ) THEN
                RAISE EXCEPTION 'idemhost: only the host may call this function'
                    USING ERRCODE = '42501';
            END IF;$check$, current_schema());
BEGIN
    SELECT c.conname INTO fk
    FROM pg_catalog.pg_constraint c
    WHERE c.conrelid = pg_catalog.format('%I.processed_message_handler', s)::regclass
      AND c.contype = 'f';
    IF fk IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %I.processed_message_handler DROP CONSTRAINT %I', s, fk);
    END IF;

    -- The cascade, once per statement: the deleted markers' version rows go with them.
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_marker_deleted() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            DELETE FROM %1$I.processed_message_handler h
            USING deleted d
            WHERE h.consumer_name = d.consumer_name AND h.message_id = d.message_id;
            RETURN NULL;
        END $body$ $f$, s);
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_markers_truncated() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            TRUNCATE %1$I.processed_message_handler;
            RETURN NULL;
        END $body$ $f$, s);
    EXECUTE format('CREATE TRIGGER idemhost_marker_deleted AFTER DELETE ON %1$I.processed_message '
        'REFERENCING OLD TABLE AS deleted FOR EACH STATEMENT '
        'EXECUTE FUNCTION %1$I.idemhost_marker_deleted()', s);
    EXECUTE format('CREATE TRIGGER idemhost_markers_truncated AFTER TRUNCATE ON %1$I.processed_message '
        'FOR EACH STATEMENT EXECUTE FUNCTION %1$I.idemhost_markers_truncated()', s);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_marker_deleted(), '
        '%1$I.idemhost_markers_truncated() FROM PUBLIC', s);

    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_session_clear(p_names text[], p_values text[], p_read_only boolean)
        RETURNS boolean
        LANGUAGE plpgsql AS $body$
        DECLARE
            i pg_catalog.int4;
        BEGIN
            RESET ALL;
            DISCARD TEMP;
            EXECUTE 'CLOSE ALL';
            UNLISTEN *;
            PERFORM pg_catalog.pg_advisory_unlock_all();
            IF p_names IS NOT NULL THEN
                FOR i IN 1 .. pg_catalog.array_length(p_names, 1) LOOP
                    PERFORM pg_catalog.set_config(p_names[i], p_values[i], true);
                END LOOP;
            END IF;
            RETURN EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statement() AS p WHERE p.from_sql)
                OR (p_read_only AND pg_catalog.current_setting('transaction_read_only')::pg_catalog.bool);
        END $body$ $f$, s);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_session_clear(text[], text[], boolean) '
        'FROM PUBLIC', s);

    -- The outbox's trigger function (0005): it runs as whoever inserts, the host's role inside
    -- idemhost_outbox_insert, so it names pg_notify with its schema and fixes its own path.
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$I.outbox_message_notify() RETURNS trigger
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            PERFORM pg_catalog.pg_notify('idemhost_outbox', '');
            RETURN NULL;
        END $body$ $f$, s);

    -- The claim of one message (0006's, with the check inline and the version row upserted).
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$I.idemhost_claim(p_key text, p_consumer text, p_id text, p_digest text)
        RETURNS boolean
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        DECLARE
            claimed pg_catalog.text;
        BEGIN
            %2$s
            INSERT INTO %1$I.processed_message (consumer_name, message_id)
            VALUES (p_consumer, p_id)
            ON CONFLICT DO NOTHING
            RETURNING message_id INTO claimed;
            IF claimed IS NULL THEN
                RETURN false;
            END IF;
            IF p_digest IS NOT NULL THEN
                INSERT INTO %1$I.processed_message_handler AS h (consumer_name, message_id, plugin_digest)
                VALUES (p_consumer, p_id, p_digest)
                ON CONFLICT (consumer_name, message_id) DO UPDATE SET plugin_digest = EXCLUDED.plugin_digest;
            END IF;
            RETURN true;
        END $body$ $f$, s, authorized);

    -- The claim of a group (0006's, likewise).
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$I.idemhost_claim_all(p_key text, p_consumer text, p_ids text[], p_digest text)
        RETURNS SETOF text
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            %2$s
            RETURN QUERY
            WITH claimed AS (
                INSERT INTO %1$I.processed_message (consumer_name, message_id)
                SELECT p_consumer, id FROM pg_catalog.unnest(p_ids) AS id ORDER BY id
                ON CONFLICT DO NOTHING
                RETURNING message_id
            ), recorded AS (
                INSERT INTO %1$I.processed_message_handler AS h (consumer_name, message_id, plugin_digest)
                SELECT p_consumer, c.message_id, p_digest FROM claimed c WHERE p_digest IS NOT NULL
                ON CONFLICT (consumer_name, message_id) DO UPDATE SET plugin_digest = EXCLUDED.plugin_digest
            )
            SELECT c.message_id FROM claimed c;
        END $body$ $f$, s, authorized);

    -- One outbox row (0006's, likewise).
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$I.idemhost_outbox_insert(p_key text, p_consumer text, p_source text,
            p_seq integer, p_subject text, p_headers jsonb, p_payload bytea) RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            %2$s
            INSERT INTO %1$I.outbox_message
                (consumer_name, source_message_id, seq, subject, headers, payload)
            VALUES (p_consumer, p_source, p_seq, p_subject, p_headers, p_payload);
        END $body$ $f$, s, authorized);
END
$migration$;
