// An idemhost handler in C: a starting point to copy.
//
// Build: `scripts/build-plugins.sh` builds it into plugins/dist/template-c.wasm; the commands it
// runs (clang for wasm32-wasi against plugins/c-bindings, then `wasm-tools component new`) are in
// plugins/templates/README.md.
//
// `NoteAdded` ({"noteId": str, "text": str}) records the note once. The host has already claimed
// the message's marker in the transaction it lends us (`tx`); every write goes through `tx`, so
// the note and the marker commit together or not at all. The `conformance.*` event types exist
// for the host's conformance suite (tests/conformance.rs); delete them in your own handler.
//
// Ownership, as the canonical ABI hands it to us: the message is ours to free; the borrowed
// transaction must be dropped before returning; an error string we return is freed by the
// bindings after the host copied it, so it must be malloc'd (handler_string_dup).

#include <stdlib.h>
#include <string.h>

#include "handler.h"
#include "json_fields.h"
#include "text.h"

typedef idemhost_consumer_database_borrow_transaction_t tx_t;
typedef idemhost_consumer_types_message_t message_t;
typedef exports_idemhost_consumer_handling_handler_error_t handler_error_t;
typedef idemhost_consumer_database_sql_value_t sql_value_t;
typedef idemhost_consumer_database_list_sql_value_t sql_params_t;

// Terminal: roll back and dead-letter, retrying cannot help (bad input, a business rule).
static bool terminal(handler_error_t *err, const char *reason) {
  err->tag = IDEMHOST_CONSUMER_TYPES_HANDLER_ERROR_TERMINAL;
  handler_string_dup(&err->val.terminal, reason);
  return false;
}

// Retryable: roll back and let the broker redeliver later with backoff. Takes `reason`.
static bool retryable(handler_error_t *err, handler_string_t reason) {
  err->tag = IDEMHOST_CONSUMER_TYPES_HANDLER_ERROR_RETRYABLE;
  err->val.retryable = reason;
  return false;
}

static void log_text(const char *level, const text_t *line) {
  handler_string_t l = {(uint8_t *)level, strlen(level)};
  handler_string_t m = {(uint8_t *)line->buf, line->len};
  idemhost_consumer_logging_log(&l, &m);
}

static sql_value_t text_value(const char *s, size_t len) {
  return (sql_value_t){.tag = IDEMHOST_CONSUMER_TYPES_SQL_VALUE_TEXT, .val.text = {(uint8_t *)s, len}};
}

// Runs a statement; on a database error fills `err` (retryable) and returns false.
static bool execute(tx_t tx, const char *sql, sql_value_t *params, size_t n, uint64_t *changed,
                    handler_error_t *err) {
  handler_string_t s = {(uint8_t *)sql, strlen(sql)}, db_err;
  sql_params_t list = {params, n};
  if (idemhost_consumer_database_method_transaction_execute(tx, &s, &list, changed, &db_err))
    return true;
  // A database error: the host has already marked the transaction for rollback and classifies
  // the SQLSTATE itself; we pass the text along.
  return retryable(err, db_err);
}

static bool note_added(tx_t tx, const message_t *msg, handler_error_t *err) {
  json_field f[2] = {{.name = "noteId", .kind = JSON_FIELD_STRING},
                     {.name = "text", .kind = JSON_FIELD_STRING}};
  char reason[256], buf[512];
  text_t line = text_on(buf, sizeof buf);
  bool ok = false;
  if (!json_fields_parse(msg->payload.ptr, msg->payload.len, f, 2, reason, sizeof reason)) {
    ok = terminal(err, text_add(text_add(&line, "malformed NoteAdded payload: "), reason)->buf);
    goto out;
  }
  if (f[1].str_len == 0) {
    ok = terminal(err, "noteId and a non-empty text are required");
    goto out;
  }
  // A business key can arrive under two message ids: ON CONFLICT DO NOTHING keeps the
  // transaction healthy (a unique violation would abort it) and the count tells us.
  sql_value_t params[3] = {text_value(f[0].str, f[0].str_len), text_value(f[1].str, f[1].str_len),
                           text_value((const char *)msg->id.ptr, msg->id.len)};
  uint64_t inserted;
  if (!execute(tx,
               "INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) "
               "ON CONFLICT (note_id) DO NOTHING",
               params, 3, &inserted, err))
    goto out;
  text_add(text_add(&line, "note "), f[0].str);
  if (inserted == 0) {
    log_text("info", text_add(&line, " already recorded"));
    ok = true;
    goto out;
  }
  handler_string_t count_sql, db_err;
  handler_string_set(&count_sql, "SELECT count(*) FROM note");
  sql_params_t none = {NULL, 0};
  idemhost_consumer_database_list_list_sql_value_t rows;
  if (!idemhost_consumer_database_method_transaction_query(tx, &count_sql, &none, &rows, &db_err)) {
    ok = retryable(err, db_err);
    goto out;
  }
  if (rows.len == 1 && rows.ptr[0].len == 1 && rows.ptr[0].ptr[0].tag == IDEMHOST_CONSUMER_TYPES_SQL_VALUE_INT) {
    text_add(text_add_i64(text_add(&line, " recorded; "), rows.ptr[0].ptr[0].val.int_), " notes");
    log_text("info", &line);
  }
  idemhost_consumer_database_list_list_sql_value_free(&rows);
  ok = true;
out:
  json_fields_free(f, 2);
  return ok;
}

// Module state lives as long as the instance, and every delivery gets a fresh instance: the
// `conformance.state` case records this counter to prove it is 1 every time.
static int64_t calls;

static bool conformance(tx_t tx, const message_t *msg, const char *kase, size_t len,
                        handler_error_t *err) {
#define IS(name) (len == sizeof(name) - 1 && memcmp(kase, name, len) == 0)
  calls++;
  if (IS("state")) {
    sql_value_t params[2] = {text_value((const char *)msg->id.ptr, msg->id.len),
                             {.tag = IDEMHOST_CONSUMER_TYPES_SQL_VALUE_INT, .val.int_ = calls}};
    uint64_t changed;
    return execute(tx, "INSERT INTO conformance_state (message_id, calls) VALUES ($1, $2)",
                   params, 2, &changed, err);
  }
  if (IS("refused-sql")) {
    handler_string_t sql, refusal;
    handler_string_set(&sql, "DELETE FROM processed_message");
    sql_params_t none = {NULL, 0};
    uint64_t changed;
    if (idemhost_consumer_database_method_transaction_execute(tx, &sql, &none, &changed, &refusal))
      return terminal(err, "the host accepted a statement on processed_message");
    sql_value_t params[2] = {text_value((const char *)msg->id.ptr, msg->id.len),
                             text_value((const char *)refusal.ptr, refusal.len)};
    bool ok = execute(tx, "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                      params, 2, &changed, err);
    handler_string_free(&refusal);
    return ok;
  }
  if (IS("trap")) __builtin_trap();
  if (IS("busy-loop")) {
    for (volatile int spin = 0;; spin++) {
    }
  }
  if (IS("retry")) {
    handler_string_t reason;
    handler_string_dup(&reason, "conformance: retry requested");
    return retryable(err, reason);
  }
  return terminal(err, "unknown conformance case");
#undef IS
}

bool exports_idemhost_consumer_handling_handle(exports_idemhost_consumer_handling_borrow_transaction_t tx,
                                               exports_idemhost_consumer_handling_message_t *msg,
                                               handler_error_t *err) {
  static const char PREFIX[] = "conformance.";
  const size_t plen = sizeof PREFIX - 1;
  handler_string_t type = msg->event_type.is_some ? msg->event_type.val : (handler_string_t){0};
  bool ok;
  if (type.len == 9 && memcmp(type.ptr, "NoteAdded", 9) == 0) {
    ok = note_added(tx, msg, err);
  } else if (type.len > plen && memcmp(type.ptr, PREFIX, plen) == 0) {
    ok = conformance(tx, msg, (const char *)type.ptr + plen, type.len - plen, err);
  } else {
    char buf[300];
    text_t reason = text_on(buf, sizeof buf);
    text_add(&reason, "unknown event type \"");
    text_addn(&reason, (const char *)type.ptr, type.len);
    ok = terminal(err, text_add(&reason, "\"")->buf);
  }
  exports_idemhost_consumer_handling_message_free(msg);
  idemhost_consumer_database_transaction_drop_borrow(tx);
  return ok;
}
