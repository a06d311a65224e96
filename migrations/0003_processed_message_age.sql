-- no-transaction
-- Markers by consumer and age: `markers prune` deletes a consumer's oldest markers in bounded
-- batches and the oldest-marker metric reads one entry, instead of scanning the whole table.
-- Built CONCURRENTLY so upgrading a host does not block deliveries writing markers (it must be
-- the migration's only statement: CONCURRENTLY cannot run in a transaction block).
CREATE INDEX CONCURRENTLY IF NOT EXISTS processed_message_age
    ON processed_message (consumer_name, processed_at);
