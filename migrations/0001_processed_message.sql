-- The marker table of the idempotent consumer pattern. One committed row per
-- (consumer_name, message_id) means that consumer's effect for that message committed with it.
CREATE TABLE processed_message (
    consumer_name text        NOT NULL,
    message_id    text        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, message_id)
);
