-- The demo's business table (examples/order-flow/migrations/0001_inventory.sql) and stock, in
-- the container config's schema. compose.yaml runs this in the PostgreSQL container at its first
-- start; scripts/demo-container.sh runs it with psql.
CREATE SCHEMA IF NOT EXISTS container_demo;
SET search_path = container_demo;
CREATE TABLE IF NOT EXISTS inventory (
    sku       text   PRIMARY KEY,
    available bigint NOT NULL CHECK (available >= 0),
    reserved  bigint NOT NULL CHECK (reserved >= 0)
);
INSERT INTO inventory (sku, available, reserved)
VALUES ('sku-1', 10, 0), ('sku-2', 10, 0), ('sku-3', 1, 0)
ON CONFLICT (sku) DO NOTHING;
