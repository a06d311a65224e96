-- The relay takes each consumer's due rows apart (a few per consumer per pass), so one
-- consumer's backlog or failing events never hold back another's: an index on
-- (consumer_name, next_attempt_at, id) of the rows not set aside finds the consumers with due
-- rows by skipping from one consumer to the next, and each one's oldest due rows.
CREATE INDEX outbox_message_consumer_due ON outbox_message (consumer_name, next_attempt_at, id)
    WHERE set_aside_at IS NULL;
