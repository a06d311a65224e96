-- A group-commit transaction claims every delivery of its group up front, in one statement.
-- With the SQL gate off, a plugin that ended the transaction itself (`COMMIT` in its handler)
-- committed the claims of the deliveries after it in the group, whose handlers had not run:
-- their redeliveries were duplicates, their effects lost (found by `wall.rs` with the gate off).
-- The group's claim now also writes a seal row, which a deferred constraint trigger checks as
-- the transaction commits: only a commit the host sent — after `SET LOCAL idemhost.seal` to
-- the seal's value, a random value the host bound as a parameter of the claim and that no
-- plugin can read (no privilege on this table) — passes; any other ends in an error, and the
-- whole group rolls back. The trigger removes the row as it passes.
DO $migration$
DECLARE
    s text := current_schema();
    digest text;
    authorized text;
    grantee text;
BEGIN
    SELECT pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
            'idemhost host functions:' OPERATOR(pg_catalog.||) k.key, 'UTF8')), 'hex')
        INTO STRICT digest
        FROM idemhost_key k;
    -- As in 0013: a UTF-8 session, and the caller presents the host key.
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

    EXECUTE format('CREATE TABLE %1$I.idemhost_group_seal (seal text PRIMARY KEY)', s);
    EXECUTE format('REVOKE ALL ON TABLE %1$I.idemhost_group_seal FROM PUBLIC', s);

    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_group_sealed() RETURNS trigger
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            IF pg_catalog.current_setting('idemhost.seal', true) IS DISTINCT FROM NEW.seal THEN
                RAISE EXCEPTION 'idemhost: a statement ended a group''s transaction before the host committed it; nothing of the group is committed'
                    USING ERRCODE = '55000';
            END IF;
            DELETE FROM %1$I.idemhost_group_seal g WHERE g.seal OPERATOR(pg_catalog.=) NEW.seal;
            RETURN NULL;
        END $body$ $f$, s);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_group_sealed() FROM PUBLIC', s);
    EXECUTE format('CREATE CONSTRAINT TRIGGER idemhost_group_sealed AFTER INSERT ON %1$I.idemhost_group_seal '
        'DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION %1$I.idemhost_group_sealed()', s);
    -- Also where triggers are off (`session_replication_role = replica`).
    EXECUTE format('ALTER TABLE %1$I.idemhost_group_seal ENABLE ALWAYS TRIGGER idemhost_group_sealed', s);

    -- The claim of a group (0013's), and the group's seal.
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_claim_all(p_key text, p_consumer text, p_ids text[], p_digest text, p_seal text)
        RETURNS SETOF text
        LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            %2$s
            IF p_seal IS NOT NULL THEN
                INSERT INTO %1$I.idemhost_group_seal (seal) VALUES (p_seal);
            END IF;
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
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_claim_all(text, text, text[], text, text) FROM PUBLIC', s);

    -- Every role granted the four-argument form (the consumers' plugin roles) is granted this one.
    FOR grantee IN
        SELECT a.grantee::pg_catalog.regrole::pg_catalog.text
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid = pg_catalog.format('%I.idemhost_claim_all(text, text, text[], text)', s)::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE'
          AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION %I.idemhost_claim_all(text, text, text[], text, text) TO %s',
            s, grantee);
    END LOOP;
END
$migration$;
