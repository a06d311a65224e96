-- The transactional outbox: a handler's `tx.publish(subject, headers, payload)` inserts a row
-- here in the delivery's own transaction, so an event exists exactly when the effect that caused
-- it committed. The host's relay publishes committed rows to JetStream with the deterministic
-- broker id `<consumer_name>/<source_message_id>/<seq>` and deletes each once the stream
-- acknowledged it; a relay that dies in between republishes the same id (absorbed by the
-- stream's duplicate window and by the downstream marker).
CREATE TABLE outbox_message (
    id                bigserial   PRIMARY KEY,
    consumer_name     text        NOT NULL,
    source_message_id text        NOT NULL,
    -- Position within the handler call (0, 1, ...): several events of one delivery keep
    -- distinct, stable ids.
    seq               integer     NOT NULL,
    subject           text        NOT NULL,
    -- [[name, value], ...] in the order given (a name may repeat).
    headers           jsonb       NOT NULL,
    payload           bytea       NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer_name, source_message_id, seq)
);

-- Wakes the relays as soon as a delivery that published commits (NOTIFY is delivered at
-- commit, and only then); they also poll, so a lost notification only delays.
CREATE FUNCTION outbox_message_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idemhost_outbox', '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_message_notify AFTER INSERT ON outbox_message
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_message_notify();
