-- The host's functions check the caller's key against the key's digest written into them,
-- instead of reading the key table on every call. The check in 0010 ran a query through the
-- function's executor per call (`SELECT 1 FROM idemhost_key WHERE sha256(...) = sha256(...)`):
-- about 16 µs of server CPU per claim here (pgbench, prepared, 16 clients), against the seed's
-- whole transaction at ~200. Now it is one expression: the SHA-256 of the key given, compared
-- with the host key's as a constant. That digest is readable in `pg_proc` by anyone who may read
-- the catalog, as the function bodies always were; it does not give the key (244 random bits),
-- which stays readable only by the host's role. It is the digest of the key behind a prefix of
-- its own, never SHA-256(key) itself: HMAC, which signs replayed ids under the key, uses
-- SHA-256(key) as its key when a key is longer than 64 bytes.
--
-- The key is therefore fixed: a trigger refuses to change or remove it (a changed key would
-- make every claim fail with 42501 until the functions were written again).
DO $migration$
DECLARE
    s text := current_schema();
    digest text;
    authorized text;
BEGIN
    SELECT pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
            'idemhost host functions:' OPERATOR(pg_catalog.||) k.key, 'UTF8')), 'hex')
        INTO STRICT digest
        FROM idemhost_key k;
    -- Each function's first statements: a UTF-8 session, and the caller presents the host key.
    -- `digest` is hexadecimal digits only (decoded once, when the expression is planned; no
    -- backslash, so `standard_conforming_strings` does not matter).
    authorized := format($check$
            IF pg_catalog.current_setting('client_encoding') OPERATOR(pg_catalog.<>) 'UTF8' THEN
                RAISE EXCEPTION 'idemhost: client_encoding is %%, not UTF8',
                    pg_catalog.current_setting('client_encoding') USING ERRCODE = '55000';
            END IF;
            IF p_key IS NULL OR pg_catalog.sha256(pg_catalog.convert_to(
                    'idemhost host functions:' OPERATOR(pg_catalog.||) p_key, 'UTF8'))
                    OPERATOR(pg_catalog.<>) pg_catalog.decode('%1$s', 'hex') THEN
                RAISE EXCEPTION 'idemhost: only the host may call this function'
                    USING ERRCODE = '42501';
            END IF;$check$, digest);

    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_key_is_fixed() RETURNS trigger
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            RAISE EXCEPTION 'idemhost: the host key cannot change: its digest is written into the host''s functions (migration 0013)'
                USING ERRCODE = '55000';
        END $body$ $f$, s);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_key_is_fixed() FROM PUBLIC', s);
    EXECUTE format('CREATE TRIGGER idemhost_key_is_fixed BEFORE UPDATE OR DELETE ON %1$I.idemhost_key '
        'FOR EACH ROW EXECUTE FUNCTION %1$I.idemhost_key_is_fixed()', s);
    EXECUTE format('CREATE TRIGGER idemhost_key_is_not_truncated BEFORE TRUNCATE ON %1$I.idemhost_key '
        'FOR EACH STATEMENT EXECUTE FUNCTION %1$I.idemhost_key_is_fixed()', s);
    -- Also where triggers are off (`session_replication_role = replica`: logical replication's
    -- apply, a restore that disables triggers).
    EXECUTE format('ALTER TABLE %1$I.idemhost_key ENABLE ALWAYS TRIGGER idemhost_key_is_fixed', s);
    EXECUTE format('ALTER TABLE %1$I.idemhost_key ENABLE ALWAYS TRIGGER idemhost_key_is_not_truncated', s);

    -- The claim of one message (0010's, with the key checked against its digest).
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

    -- The claim of a group (0010's, likewise).
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

    -- One outbox row (0010's, likewise).
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
