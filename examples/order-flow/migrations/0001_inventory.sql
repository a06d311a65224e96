-- The seed's inventory table, owned by the example (not by the host).
CREATE TABLE IF NOT EXISTS inventory (
    sku       text   PRIMARY KEY,
    available bigint NOT NULL CHECK (available >= 0),
    reserved  bigint NOT NULL CHECK (reserved >= 0)
);
