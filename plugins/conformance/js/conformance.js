// The host's conformance cases in JavaScript (tests/system/conformance.rs runs the same cases
// against every language's build), against WIT 0.2.0: `NoteAdded` as the template handles it,
// and a `conformance.<case>` event type per case.

const terminal = (reason) => ({ tag: 'terminal', val: reason });
const retryable = (reason) => ({ tag: 'retryable', val: reason });
const text = (val) => ({ tag: 'text', val });

// A database error arrives as a thrown value whose `payload` is the db-error.
const dbError = (e) => (e && typeof e === 'object' && e.payload && typeof e.payload.message === 'string' ? e.payload : { kind: 'other', message: String(e) });

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
  try {
    tx.execute('INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) ON CONFLICT (note_id) DO NOTHING', [
      text(noteId),
      text(body),
      text(msg.id),
    ]);
  } catch (e) {
    throw retryable(dbError(e).message);
  }
}

// Module state lives as long as the instance, and every delivery gets a fresh instance: the
// `state` case records this counter to prove it is 1 every time.
let calls = 0;

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
        refusal = dbError(e);
      }
      if (refusal === undefined) throw terminal('the host accepted a statement on processed_message');
      if (refusal.kind !== 'refused') throw terminal(`the refusal came as ${refusal.kind}`);
      // The refusal already fails the attempt; this write only shows it is not committed.
      try {
        tx.execute('INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)', [text(msg.id), text(refusal.message)]);
      } catch (e) {
        throw retryable(dbError(e).message);
      }
      return;
    }
    case 'unique': {
      // The same key twice: a unique violation, which this handler treats as terminal.
      const insert = "INSERT INTO conformance_unique (k, message_id) VALUES ('k', $1)";
      try {
        tx.execute(insert, [text(msg.id)]);
        tx.execute(insert, [text(msg.id)]);
      } catch (e) {
        const err = dbError(e);
        if (err.kind === 'unique-violation') throw terminal(`duplicate: ${err.sqlstate} ${err.constraint}`);
        throw retryable(err.message);
      }
      throw terminal('no unique violation');
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
  handle(tx, msg) {
    const eventType = msg.eventType ?? '';
    if (eventType === 'NoteAdded') return noteAdded(tx, msg);
    if (eventType.startsWith('conformance.')) return conformance(tx, msg, eventType.slice('conformance.'.length));
    throw terminal(`unknown event type ${JSON.stringify(eventType)}`);
  },
};
