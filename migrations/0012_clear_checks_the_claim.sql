-- The check that a delivery commits in the transaction its claim ran in moves into the
-- session's clearing. The host checked it with a statement of its own before the clearing,
-- sent in the COMMIT's round trip with the claim's transaction id written into it: the server
-- parsed and planned that statement for every delivery (scripts/bench-wall.sh: 584 against 502
-- µs of server CPU per transaction, 16 clients, three rounds). `idemhost_session_clear` now takes that id as a fourth argument and checks it
-- first, with the same error (22P02, a message naming the cause); NULL checks nothing (the
-- clearing after a ROLLBACK, between two deliveries of a group).
--
-- The three-argument form stays as it was, for hosts of an earlier version still running against
-- this schema (replicas upgraded one by one).
DO $migration$
DECLARE
    s text := current_schema();
    grantee text;
BEGIN
    EXECUTE format($f$
        CREATE FUNCTION %1$I.idemhost_session_clear(p_names text[], p_values text[],
            p_read_only boolean, p_claimed_in text)
        RETURNS boolean
        LANGUAGE plpgsql AS $body$
        DECLARE
            i pg_catalog.int4;
        BEGIN
            IF p_claimed_in IS NOT NULL AND COALESCE(
                    pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.text, '')
                    OPERATOR(pg_catalog.<>) p_claimed_in THEN
                RAISE EXCEPTION 'idemhost: the transaction is not the one the delivery claimed in (a statement ended it), backend %%',
                    pg_catalog.pg_backend_pid() USING ERRCODE = '22P02';
            END IF;
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
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$I.idemhost_session_clear(text[], text[], boolean, text) '
        'FROM PUBLIC', s);

    -- Every role granted the old form (the consumers' plugin roles) is granted the new one.
    FOR grantee IN
        SELECT a.grantee::pg_catalog.regrole::pg_catalog.text
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid = pg_catalog.format('%I.idemhost_session_clear(text[], text[], boolean)', s)::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE'
          AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION %I.idemhost_session_clear(text[], text[], boolean, text) TO %s',
            s, grantee);
    END LOOP;
END
$migration$;
