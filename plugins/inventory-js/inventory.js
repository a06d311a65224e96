// The seed's inventory reservation as an idemhost plugin in JavaScript.
//
// Build: `scripts/build-plugins.sh` (componentize-js, pinned in plugins/toolchain/package-lock.json).
// It does exactly what the Rust plugin (plugins/inventory) does: the same JSON rules, the same
// SQL, the same errors. The host has already claimed the message's marker in the transaction it
// lends us; all this does is the business mutation, in that same transaction.
//
// JSON.parse would round integers above 2^53 and keep the last of duplicated keys, where the Rust
// plugin (serde_json) keeps every i64 exact and refuses duplicates, so the payload goes through
// the small strict parser in ./json.js instead.

import { log } from 'idemhost:consumer/logging@0.2.0';
import { parseJson, Malformed } from './json.js';

const RESERVE =
  'UPDATE inventory SET available = available - $1, reserved = reserved + $1 ' +
  'WHERE sku = $2 AND available >= $1';

// OrderPlaced's fields and their JSON types, as the Rust plugin's serde struct declares them.
// Unknown fields are ignored; a missing, duplicated or mistyped one is malformed.
const FIELDS = { id: 'string', orderId: 'string', sku: 'string', quantity: 'integer' };

const I64_MIN = -(2n ** 63n);
const I64_MAX = 2n ** 63n - 1n;

const terminal = (val) => ({ tag: 'terminal', val });
const retryable = (val) => ({ tag: 'retryable', val });

function parseOrderPlaced(payload) {
  const event = parseJson(payload, Object.keys(FIELDS));
  if (event === null || typeof event !== 'object' || Array.isArray(event)) {
    throw new Malformed('expected an object');
  }
  for (const [name, kind] of Object.entries(FIELDS)) {
    if (!Object.hasOwn(event, name)) throw new Malformed(`missing field \`${name}\``);
    const value = event[name];
    const ok = kind === 'integer' ? typeof value === 'bigint' : typeof value === kind;
    if (!ok) throw new Malformed(`invalid type for \`${name}\`: expected ${kind}`);
  }
  if (event.quantity < I64_MIN || event.quantity > I64_MAX) {
    throw new Malformed('invalid value for `quantity`: out of range for i64');
  }
  return event;
}

// A database error from the host arrives as a thrown value whose `payload` is the db-error
// (`kind`, `sqlstate`, `message`, `detail`, `constraint`).
function errorText(e) {
  const p = e && e.payload;
  if (p && typeof p.message === 'string') return p.sqlstate ? `${p.sqlstate}: ${p.message}` : p.message;
  return String(e && e.message !== undefined ? e.message : e);
}

export const handling = {
  handle(tx, msg) {
    let event;
    try {
      event = parseOrderPlaced(msg.payload);
    } catch (e) {
      if (e instanceof Malformed) throw terminal(`malformed OrderPlaced payload: ${e.message}`);
      throw e;
    }
    const { orderId, quantity, sku } = event;
    if (quantity <= 0n) throw terminal(`quantity must be positive for ${orderId}`);
    // A SQL error already poisoned the host's transaction; the host classifies it
    // (serialization failures are retried whole), so we only pass its text along.
    let changed;
    try {
      changed = tx.execute(RESERVE, [
        { tag: 'int', val: quantity },
        { tag: 'text', val: sku },
      ]);
    } catch (e) {
      throw retryable(errorText(e));
    }
    if (changed !== 1n) throw terminal(`Unknown SKU or insufficient inventory for ${orderId}`);
    log('debug', `reserved ${quantity} for ${orderId}`);
  },
};
