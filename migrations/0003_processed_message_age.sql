-- Markers by consumer and age: `markers prune` deletes a consumer's oldest markers in bounded
-- batches and the oldest-marker metric reads one index entry, instead of scanning the table.
--
-- A plain CREATE INDEX blocks marker inserts while it builds (seconds per million markers).
-- For a large existing table, build it beforehand without blocking, then upgrade — this
-- statement is then a no-op:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS processed_message_age
--       ON processed_message (consumer_name, processed_at);
-- (CONCURRENTLY cannot run inside a migration: it waits for every other transaction, including
-- a second host waiting for the migration lock, and the two deadlock.)
CREATE INDEX IF NOT EXISTS processed_message_age
    ON processed_message (consumer_name, processed_at);
