-- The order flow's business tables (owned by the example, not by the host). Each carries the
-- business key that makes its effect idempotent beyond the host's per-message marker.

-- The order aggregate's state, for events that arrive out of order: a cancellation before the
-- placement leaves a 'cancelled' row, and the placement that follows reserves nothing.
CREATE TABLE IF NOT EXISTS order_state (
    order_id text    PRIMARY KEY,
    status   text    NOT NULL CHECK (status IN ('placed', 'cancelled')),
    version  integer NOT NULL
);

-- inventory-reservation-v1: one reservation per (order, sku), whatever the message ids.
CREATE TABLE IF NOT EXISTS inventory_reservation (
    order_id   text   NOT NULL,
    sku        text   NOT NULL,
    quantity   bigint NOT NULL CHECK (quantity > 0),
    message_id text   NOT NULL,
    status     text   NOT NULL DEFAULT 'reserved' CHECK (status IN ('reserved', 'released')),
    UNIQUE (order_id, sku)
);

-- payment-authorization-v1: one attempt per (order, attempt number); the idempotency key the
-- provider dedupes by is derived from the attempt, not from any message id.
CREATE TABLE IF NOT EXISTS payment_attempt (
    order_id         text    NOT NULL,
    attempt          integer NOT NULL,
    idempotency_key  text    NOT NULL UNIQUE,
    amount           bigint  NOT NULL,
    status           text    NOT NULL CHECK (status IN ('requested', 'authorized')),
    authorization_id text,
    PRIMARY KEY (order_id, attempt)
);

-- The fake payment provider's own ledger: one authorization per idempotency key.
CREATE TABLE IF NOT EXISTS provider_authorization (
    idempotency_key  text        PRIMARY KEY,
    authorization_id text        NOT NULL UNIQUE,
    order_id         text        NOT NULL,
    amount           bigint      NOT NULL,
    authorized_at    timestamptz NOT NULL DEFAULT now()
);

-- notification-v1: one notification per order.
CREATE TABLE IF NOT EXISTS notification (
    order_id   text        PRIMARY KEY,
    message_id text        NOT NULL,
    body       text        NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);

-- analytics-v1: one row per OrderPlaced message it consumed.
CREATE TABLE IF NOT EXISTS order_analytics (
    message_id text   PRIMARY KEY,
    order_id   text   NOT NULL,
    sku        text   NOT NULL,
    quantity   bigint NOT NULL
);
