// An idemhost handler in C: a starting point to copy.
//
// Build: `idemhost plugin build` in a project `idemhost plugin new --lang c` made; in this
// repository `scripts/build-plugins.sh` builds it into plugins/dist/template-c.wasm (the
// commands are in plugins/templates/README.md).
//
// `NoteAdded` ({"noteId": str, "text": str}) records the note once. The host has already claimed
// the message's marker in the transaction it lends us (`tx`); every write goes through `tx`, so
// the note and the marker commit together or not at all. `max_note_bytes` comes from the
// consumer's `[consumer.config]` table.
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
typedef idemhost_consumer_types_db_error_t db_error_t;

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

// What a failed database call means for the message (takes `e`). The host has already marked
// the transaction for rollback (and runs it again after a serialization failure or a deadlock,
// whatever we answer); we decide: the data itself refused (a constraint, a bad value) is
// terminal, redelivering cannot help; anything else (a timeout, a missing table, a refusal) is
// retryable.
static bool db_error(handler_error_t *err, db_error_t *e) {
  char buf[1200];
  text_t reason = text_on(buf, sizeof buf);
  text_addn(&reason, (const char *)e->message.ptr, e->message.len);
  bool data = e->kind <= IDEMHOST_CONSUMER_TYPES_DB_ERROR_KIND_INVALID_VALUE;
  if (data) {
    text_add(&reason, " (");
    if (e->constraint.is_some)
      text_addn(&reason, (const char *)e->constraint.val.ptr, e->constraint.val.len);
    else
      text_add(&reason, "no constraint");
    text_add(&reason, ")");
  }
  idemhost_consumer_types_db_error_free(e);
  if (data) return terminal(err, reason.buf);
  handler_string_t r;
  handler_string_dup(&r, reason.buf);
  return retryable(err, r);
}

// Runs a statement; on a database error fills `err` (see db_error) and returns false.
static bool execute(tx_t tx, const char *sql, sql_value_t *params, size_t n, uint64_t *changed,
                    handler_error_t *err) {
  handler_string_t s = {(uint8_t *)sql, strlen(sql)};
  sql_params_t list = {params, n};
  db_error_t e;
  if (idemhost_consumer_database_method_transaction_execute(tx, &s, &list, changed, &e))
    return true;
  return db_error(err, &e);
}

// `key` of the consumer's `[consumer.config]` as a count, or `fallback` when it has none.
static uint64_t config_count(const char *key, uint64_t fallback) {
  handler_string_t k = {(uint8_t *)key, strlen(key)}, v;
  if (!idemhost_consumer_config_get(&k, &v)) return fallback;
  uint64_t n = 0;
  bool digits = v.len > 0 && v.len < 19;
  for (size_t i = 0; digits && i < v.len; i++) {
    digits = v.ptr[i] >= '0' && v.ptr[i] <= '9';
    n = n * 10 + (v.ptr[i] - '0');
  }
  handler_string_free(&v);
  return digits ? n : fallback;
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
  uint64_t max_bytes = config_count("max_note_bytes", 10000);
  if (f[1].str_len > max_bytes) {
    text_add(&line, "a note's text must be 1 to ");
    text_add_i64(&line, (int64_t)max_bytes);
    ok = terminal(err, text_add(&line, " bytes")->buf);
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
  handler_string_t count_sql;
  handler_string_set(&count_sql, "SELECT count(*) FROM note");
  sql_params_t none = {NULL, 0};
  idemhost_consumer_database_list_list_sql_value_t rows;
  db_error_t e;
  if (!idemhost_consumer_database_method_transaction_query(tx, &count_sql, &none, &rows, &e)) {
    ok = db_error(err, &e);
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

bool exports_idemhost_consumer_handling_handle(exports_idemhost_consumer_handling_borrow_transaction_t tx,
                                               exports_idemhost_consumer_handling_message_t *msg,
                                               handler_error_t *err) {
  handler_string_t type = msg->event_type.is_some ? msg->event_type.val : (handler_string_t){0};
  bool ok;
  if (type.len == 9 && memcmp(type.ptr, "NoteAdded", 9) == 0) {
    ok = note_added(tx, msg, err);
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
