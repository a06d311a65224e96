// The host's conformance cases in C (tests/system/conformance.rs runs the same cases against
// every language's build), against WIT 0.2.0: `NoteAdded` as the template handles it, and a
// `conformance.<case>` event type per case.

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
    handler_string_t sql;
    db_error_t refusal;
    handler_string_set(&sql, "DELETE FROM processed_message");
    sql_params_t none = {NULL, 0};
    uint64_t changed;
    if (idemhost_consumer_database_method_transaction_execute(tx, &sql, &none, &changed, &refusal))
      return terminal(err, "the host accepted a statement on processed_message");
    if (refusal.kind != IDEMHOST_CONSUMER_TYPES_DB_ERROR_KIND_REFUSED) {
      idemhost_consumer_types_db_error_free(&refusal);
      return terminal(err, "the refusal came as another kind");
    }
    // The refusal already fails the attempt; this write only shows it is not committed.
    sql_value_t params[2] = {text_value((const char *)msg->id.ptr, msg->id.len),
                             text_value((const char *)refusal.message.ptr, refusal.message.len)};
    bool ok = execute(tx, "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                      params, 2, &changed, err);
    idemhost_consumer_types_db_error_free(&refusal);
    return ok;
  }
  if (IS("unique")) {
    // The same key twice: a unique violation, which this handler treats as terminal.
    handler_string_t sql;
    handler_string_set(&sql, "INSERT INTO conformance_unique (k, message_id) VALUES ('k', $1)");
    sql_value_t params[1] = {text_value((const char *)msg->id.ptr, msg->id.len)};
    sql_params_t list = {params, 1};
    uint64_t changed;
    db_error_t e;
    for (int i = 0; i < 2; i++) {
      if (idemhost_consumer_database_method_transaction_execute(tx, &sql, &list, &changed, &e))
        continue;
      if (e.kind != IDEMHOST_CONSUMER_TYPES_DB_ERROR_KIND_UNIQUE_VIOLATION) {
        handler_string_t r;
        handler_string_dup_n(&r, (const char *)e.message.ptr, e.message.len);
        idemhost_consumer_types_db_error_free(&e);
        return retryable(err, r);
      }
      char buf[300];
      text_t reason = text_on(buf, sizeof buf);
      text_add(&reason, "duplicate: ");
      if (e.sqlstate.is_some) text_addn(&reason, (const char *)e.sqlstate.val.ptr, e.sqlstate.val.len);
      text_add(&reason, " ");
      if (e.constraint.is_some)
        text_addn(&reason, (const char *)e.constraint.val.ptr, e.constraint.val.len);
      idemhost_consumer_types_db_error_free(&e);
      return terminal(err, reason.buf);
    }
    return terminal(err, "no unique violation");
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
