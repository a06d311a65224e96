// An idemhost handler in JavaScript: a starting point to copy.
//
// Build: `idemhost plugin build` in a project `idemhost plugin new --lang js` made; in this
// repository `scripts/build-plugins.sh` builds it into plugins/dist/template-js.wasm.
//
// `NoteAdded` ({"noteId": string, "text": string}) records the note once. The host has already
// claimed the message's marker in the transaction it lends us (`tx`); every write goes through
// `tx`, so the note and the marker commit together or not at all. `max_note_bytes` comes from
// the consumer's `[consumer.config]` table.

import { get as configValue } from 'idemhost:consumer/config@0.2.0';
import { log } from 'idemhost:consumer/logging@0.2.0';

// The world's types, for an editor and `tsc -p jsconfig.json` (declarations in types/, which
// `idemhost plugin build` keeps current); JSDoc only, nothing changes at run time.
/** @typedef {import('idemhost:consumer/database@0.2.0').Transaction} Transaction */
/** @typedef {import('idemhost:consumer/types@0.2.0').Message} Message */
/** @typedef {import('idemhost:consumer/types@0.2.0').HandlerError} HandlerError */
/** @typedef {import('idemhost:consumer/types@0.2.0').SqlValue} SqlValue */
/** @typedef {import('idemhost:consumer/types@0.2.0').DbError} DbError */

// Roll back and dead-letter: retrying cannot help (bad input, a broken business rule).
/** @type {(reason: string) => HandlerError} */
const terminal = (reason) => ({ tag: 'terminal', val: reason });
// Roll back and let the broker redeliver later with backoff.
/** @type {(reason: string) => HandlerError} */
const retryable = (reason) => ({ tag: 'retryable', val: reason });
/** @type {(val: string) => SqlValue} */
const text = (val) => ({ tag: 'text', val });

// Database errors that mean the data itself is refused: redelivering cannot help.
const DATA_ERRORS = new Set([
  'unique-violation',
  'foreign-key-violation',
  'check-violation',
  'not-null-violation',
  'integrity-violation',
  'invalid-value',
]);

// What a failed database call means for the message. It arrives as a thrown value whose
// `payload` is the db-error. The host has already marked the transaction for rollback (and runs
// it again after a serialization failure or a deadlock, whatever we answer); we decide between
// dead-lettering and redelivering.
/** @type {(e: unknown) => HandlerError} */
function dbError(e) {
  /** @type {DbError | undefined} */
  const err = typeof e === 'object' && e !== null && 'payload' in e ? /** @type {any} */ (e).payload : undefined;
  if (err === undefined) return retryable(String(e));
  if (DATA_ERRORS.has(err.kind)) return terminal(`${err.message} (${err.constraint ?? 'no constraint'})`);
  return retryable(err.message);
}

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
  const limit = Number.parseInt(configValue('max_note_bytes') ?? '', 10);
  const maxBytes = Number.isSafeInteger(limit) ? limit : 10000;
  if (new TextEncoder().encode(body).length > maxBytes) {
    throw terminal(`a note's text must be 1 to ${maxBytes} bytes`);
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
    throw dbError(e);
  }
  const count = rows[0]?.[0];
  log('info', `note ${noteId} recorded; ${count && 'val' in count ? count.val : '?'} notes`);
}

export const handling = {
  /**
   * @param {Transaction} tx
   * @param {Message} msg
   */
  handle(tx, msg) {
    const eventType = msg.eventType ?? '';
    if (eventType === 'NoteAdded') return noteAdded(tx, msg);
    throw terminal(`unknown event type ${JSON.stringify(eventType)}`);
  },
};
