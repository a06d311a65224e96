-- The plugin wall (SECURITY.md). A plugin's SQL runs on connections that log in as its
-- consumer's role, which has no privilege on the host's tables. The host's own writes inside a
-- delivery's transaction (the claim, the plugin version record, outbox rows) go through the
-- functions below: they run as their owner (the host's role), with a fixed search_path and
-- every table named with its schema, and only for a caller that presents the host key — a
-- secret the host reads at start and sends as a bound parameter, so no plugin ever sees it.

CREATE TABLE idemhost_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    -- 244 random bits from pg_strong_random (two version-4 UUIDs).
    key      text    NOT NULL
);
INSERT INTO idemhost_key (key)
    VALUES (replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''));

REVOKE ALL ON idemhost_key, processed_message, processed_message_handler, dead_letter_repair,
    outbox_message FROM PUBLIC;
REVOKE ALL ON SEQUENCE outbox_message_id_seq FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_message_notify() FROM PUBLIC;

-- The schema is only known when the migration runs (`postgres.schema`, else the first schema
-- of the search path): the functions are written with it.
DO $migration$
DECLARE
    s text := current_schema();
BEGIN
    -- Raises 42501 unless p_key is the host key (compared as digests).
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_authorize(p_key text) RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            -- Text parameters are read in the session's client_encoding: one a plugin changed
            -- (e.g. through a function that runs SQL) would store another id than the one sent.
            IF current_setting('client_encoding') <> 'UTF8' THEN
                RAISE EXCEPTION 'idemhost: client_encoding is %%, not UTF8',
                    current_setting('client_encoding') USING ERRCODE = '55000';
            END IF;
            IF p_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM %1$I.idemhost_key k
                WHERE sha256(convert_to(k.key, 'UTF8')) = sha256(convert_to(p_key, 'UTF8'))
            ) THEN
                RAISE EXCEPTION 'idemhost: only the host may call this function'
                    USING ERRCODE = '42501';
            END IF;
        END $body$ $f$, s);

    -- The pattern's claim of one message, and the plugin version beside a new marker: true
    -- when this transaction now owns (consumer, id).
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_claim(p_key text, p_consumer text, p_id text, p_digest text)
        RETURNS boolean
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        DECLARE
            claimed text;
        BEGIN
            PERFORM %1$I.idemhost_authorize(p_key);
            INSERT INTO %1$I.processed_message (consumer_name, message_id)
            VALUES (p_consumer, p_id)
            ON CONFLICT DO NOTHING
            RETURNING message_id INTO claimed;
            IF claimed IS NULL THEN
                RETURN false;
            END IF;
            IF p_digest IS NOT NULL THEN
                INSERT INTO %1$I.processed_message_handler (consumer_name, message_id, plugin_digest)
                VALUES (p_consumer, p_id, p_digest);
            END IF;
            RETURN true;
        END $body$ $f$, s);

    -- The claim of a group-commit batch, ids inserted in sorted order (two batches with common
    -- ids lock them in the same order): the ids this transaction now owns.
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_claim_all(p_key text, p_consumer text, p_ids text[], p_digest text)
        RETURNS SETOF text
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            PERFORM %1$I.idemhost_authorize(p_key);
            RETURN QUERY
            WITH claimed AS (
                INSERT INTO %1$I.processed_message (consumer_name, message_id)
                SELECT p_consumer, id FROM unnest(p_ids) AS id ORDER BY id
                ON CONFLICT DO NOTHING
                RETURNING message_id
            ), recorded AS (
                INSERT INTO %1$I.processed_message_handler (consumer_name, message_id, plugin_digest)
                SELECT p_consumer, c.message_id, p_digest FROM claimed c WHERE p_digest IS NOT NULL
            )
            SELECT c.message_id FROM claimed c;
        END $body$ $f$, s);

    -- One outbox row of the delivery's transaction (see 0005).
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_outbox_insert(p_key text, p_consumer text, p_source text,
            p_seq integer, p_subject text, p_headers jsonb, p_payload bytea) RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            PERFORM %1$I.idemhost_authorize(p_key);
            INSERT INTO %1$I.outbox_message
                (consumer_name, source_message_id, seq, subject, headers, payload)
            VALUES (p_consumer, p_source, p_seq, p_subject, p_headers, p_payload);
        END $body$ $f$, s);

    -- Functions are executable by PUBLIC unless revoked: the host grants the claim and outbox
    -- functions to each consumer role it checked; authorize is only called from them.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_authorize(text), '
        '%1$I.idemhost_claim(text, text, text, text), '
        '%1$I.idemhost_claim_all(text, text, text[], text), '
        '%1$I.idemhost_outbox_insert(text, text, text, integer, text, jsonb, bytea) FROM PUBLIC', s);
END
$migration$;
