-- The relay takes due rows in the order they became due: an index on (next_attempt_at, id) of
-- the rows not set aside lets it skip rows still backing off without reading them, and one on
-- the set-aside rows keeps their count (idemhost_outbox_set_aside) cheap.
DROP INDEX outbox_message_relayed;
CREATE INDEX outbox_message_due ON outbox_message (next_attempt_at, id) WHERE set_aside_at IS NULL;
CREATE INDEX outbox_message_set_aside ON outbox_message (id) WHERE set_aside_at IS NOT NULL;
