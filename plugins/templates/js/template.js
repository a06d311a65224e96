// An idemhost handler in JavaScript: a starting point to copy.
//
// Build: `scripts/build-plugins.sh` builds it into plugins/dist/template-js.wasm; on your own:
// `npx componentize-js template.js --wit wit --world-name handler -d stdio random clocks http fetch-event -o handler.wasm`.
//
// `NoteAdded` ({"noteId": string, "text": string}) records the note once. The host has already
// claimed the message's marker in the transaction it lends us (`tx`); every write goes through
// `tx`, so the note and the marker commit together or not at all. The `conformance.*` event types
// exist for the host's conformance suite (tests/conformance.rs); delete them in your own
// handler.

import { log } from 'idemhost:consumer/logging@0.1.0';

// The world's types, for an editor and `tsc -p jsconfig.json` (declarations in types/, which
// `idemhost plugin build` keeps current); JSDoc only, nothing changes at run time.
/** @typedef {import('idemhost:consumer/database@0.1.0').Transaction} Transaction */
/** @typedef {import('idemhost:consumer/types@0.1.0').Message} Message */
/** @typedef {import('idemhost:consumer/types@0.1.0').HandlerError} HandlerError */
/** @typedef {import('idemhost:consumer/types@0.1.0').SqlValue} SqlValue */

// Roll back and dead-letter: retrying cannot help (bad input, a broken business rule).
/** @type {(reason: string) => HandlerError} */
const terminal = (reason) => ({ tag: 'terminal', val: reason });
// Roll back and let the broker redeliver later with backoff.
/** @type {(reason: string) => HandlerError} */
const retryable = (reason) => ({ tag: 'retryable', val: reason });
/** @type {(val: string) => SqlValue} */
const text = (val) => ({ tag: 'text', val });

// A database error arrives as a thrown value carrying the error string.
/** @param {unknown} e */
const errorText = (e) =>
  typeof e === 'string' ? e : typeof e === 'object' && e !== null && 'payload' in e && typeof e.payload === 'string' ? e.payload : String(e);

/**
 * @param {Transaction} tx
 * @param {Message} msg
 */
function noteAdded(tx, msg) {
  let event;
  try {
    event = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(msg.payload));
  } catch (e) {
    throw terminal(`malformed NoteAdded payload: ${e}`);
  }
  const { noteId, text: body } = event ?? {};
  if (typeof noteId !== 'string' || typeof body !== 'string' || body === '') {
    throw terminal('noteId and a non-empty text are required');
  }
  let inserted, rows;
  try {
    // A business key can arrive under two message ids: ON CONFLICT DO NOTHING keeps the
    // transaction healthy (a unique violation would abort it) and the count tells us.
    inserted = tx.execute(
      'INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) ON CONFLICT (note_id) DO NOTHING',
      [text(noteId), text(body), text(msg.id)],
    );
    if (inserted === 0n) {
      log('info', `note ${noteId} already recorded`);
      return;
    }
    rows = tx.query('SELECT count(*) FROM note', []);
  } catch (e) {
    // A database error: the host has already marked the transaction for rollback and
    // classifies the SQLSTATE itself; we pass the text along.
    throw retryable(errorText(e));
  }
  const count = rows[0]?.[0];
  log('info', `note ${noteId} recorded; ${count && 'val' in count ? count.val : '?'} notes`);
}

// Module state lives as long as the instance, and every delivery gets a fresh instance: the
// `conformance.state` case records this counter to prove it is 1 every time.
let calls = 0;

/**
 * @param {Transaction} tx
 * @param {Message} msg
 * @param {string} kase
 */
function conformance(tx, msg, kase) {
  calls += 1;
  switch (kase) {
    case 'state':
      tx.execute('INSERT INTO conformance_state (message_id, calls) VALUES ($1, $2)', [text(msg.id), { tag: 'int', val: BigInt(calls) }]);
      return;
    case 'refused-sql': {
      let refusal;
      try {
        tx.execute('DELETE FROM processed_message', []);
      } catch (e) {
        refusal = errorText(e);
      }
      if (refusal === undefined) throw terminal('the host accepted a statement on processed_message');
      // The refusal already fails the attempt; this write only shows it is not committed.
      try {
        tx.execute('INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)', [text(msg.id), text(refusal)]);
      } catch (e) {
        throw retryable(errorText(e));
      }
      return;
    }
    case 'trap':
      throw new Error('conformance: trap requested'); // not a handler-error: the component traps
    case 'busy-loop':
      for (;;) {}
    case 'retry':
      throw retryable('conformance: retry requested');
    default:
      throw terminal(`unknown conformance case ${kase}`);
  }
}

export const handling = {
  /**
   * @param {Transaction} tx
   * @param {Message} msg
   */
  handle(tx, msg) {
    const eventType = msg.eventType ?? '';
    if (eventType === 'NoteAdded') return noteAdded(tx, msg);
    if (eventType.startsWith('conformance.')) return conformance(tx, msg, eventType.slice('conformance.'.length));
    throw terminal(`unknown event type ${JSON.stringify(eventType)}`);
  },
};
