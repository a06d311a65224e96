-- Outbox rows that fail to publish (no stream captures the subject, the stream refuses the
-- event) back off on their own instead of blocking the rows behind them: each failure counts an
-- attempt, records its reason and moves the row's next attempt later (exponential, capped).
-- A row that has failed `outbox.max_attempts` times is set aside: the relay leaves it, the
-- operator sees it (`idemhost outbox list`, `idemhost_outbox_set_aside`) and sends it again
-- with `idemhost outbox retry` once the cause is fixed. Nothing is deleted before the stream
-- acknowledged it.
ALTER TABLE outbox_message
    ADD COLUMN attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN next_attempt_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN last_error      text,
    ADD COLUMN set_aside_at    timestamptz;

-- What the relay takes: rows not set aside, oldest first.
CREATE INDEX outbox_message_relayed ON outbox_message (id) WHERE set_aside_at IS NULL;
