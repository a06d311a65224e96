-- The audit trail of intentional reprocessing: `idemhost dlq replay --repair-key KEY`
-- republishes a dead letter under a new message id (so it applies even though the original id
-- has a marker). Every such replay is recorded here first; a repair key is used at most once
-- per consumer.
CREATE TABLE dead_letter_repair (
    consumer_name       text        NOT NULL,
    repair_key          text        NOT NULL,
    original_message_id text        NOT NULL,
    reason              text        NOT NULL,
    requested_by        text        NOT NULL,
    requested_at        timestamptz NOT NULL DEFAULT now(),
    dead_letter_stream  text        NOT NULL,
    dead_letter_seq     bigint      NOT NULL,
    PRIMARY KEY (consumer_name, repair_key)
);
