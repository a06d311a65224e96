-- The outbox's notification names its schema. Every host's relay listens on one channel,
-- `idemhost_outbox`, and the trigger notified it with an empty payload, so a commit that wrote
-- one schema's outbox woke the relay of every other schema in the database for a pass over its
-- own table: with many consumers' hosts in one database, each one's outbox traffic became
-- everyone's scans. The payload is now the schema's name; a relay passes only for its own
-- (and for an empty payload, which a schema migrated before this one still sends).
DO $migration$
DECLARE
    s text := current_schema();
BEGIN
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION %1$I.outbox_message_notify() RETURNS trigger
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $body$
        BEGIN
            PERFORM pg_catalog.pg_notify('idemhost_outbox', TG_TABLE_SCHEMA);
            RETURN NULL;
        END $body$ $f$, s);
END
$migration$;
