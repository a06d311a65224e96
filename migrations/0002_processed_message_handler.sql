-- Which plugin version applied each message: written in the delivery's transaction, next to
-- the marker, when a WASM plugin handled it (native handlers have no digest and write none).
-- The marker table keeps exactly its three columns; pruning a marker removes this row too.
CREATE TABLE processed_message_handler (
    consumer_name text NOT NULL,
    message_id    text NOT NULL,
    plugin_digest text NOT NULL,
    PRIMARY KEY (consumer_name, message_id),
    FOREIGN KEY (consumer_name, message_id)
        REFERENCES processed_message (consumer_name, message_id) ON DELETE CASCADE
);
