// The seed's inventory reservation as an idemhost plugin in C.
//
// Build: `scripts/build-plugins.sh` (clang-14 for wasm32-wasi, then `wasm-tools component new`;
// the bindings in plugins/c-bindings come from `wit-bindgen c`). It does exactly what the Rust
// plugin (plugins/inventory) does: the same JSON rules, the same SQL, the same errors. The host
// has already claimed the message's marker in the transaction it lends us; all this does is the
// business mutation, in that same transaction.
//
// Ownership, as the canonical ABI hands it to us: the message is ours to free; the borrowed
// transaction must be dropped before returning; an error string we return is freed by the
// bindings after the host copied it, so it must be malloc'd.

#include <stdlib.h>
#include <string.h>

#include "handler.h"
#include "json_fields.h"
#include "text.h"

typedef idemhost_consumer_database_borrow_transaction_t tx_t;
typedef exports_idemhost_consumer_handling_handler_error_t handler_error_t;

static const char RESERVE[] =
    "UPDATE inventory SET available = available - $1, reserved = reserved + $1 "
    "WHERE sku = $2 AND available >= $1";

// Returns false after filling `err` (the bindings free its string once the host copied it).
static bool fail(handler_error_t *err, uint8_t tag, const text_t *reason) {
  err->tag = tag;
  handler_string_dup_n(&err->val.terminal, reason->buf, reason->len);  // one layout for both
  return false;
}

static void log_line(const char *level, const text_t *line) {
  handler_string_t l, m;
  handler_string_set(&l, level);
  m = (handler_string_t){(uint8_t *)line->buf, line->len};
  idemhost_consumer_logging_log(&l, &m);
}

// OrderPlaced's fields, as the Rust plugin's serde struct declares them.
enum { F_ID, F_ORDER_ID, F_SKU, F_QUANTITY, F_COUNT };

static bool reserve(tx_t tx, const idemhost_consumer_types_message_t *msg, handler_error_t *err) {
  json_field f[F_COUNT] = {
      [F_ID] = {.name = "id", .kind = JSON_FIELD_STRING},
      [F_ORDER_ID] = {.name = "orderId", .kind = JSON_FIELD_STRING},
      [F_SKU] = {.name = "sku", .kind = JSON_FIELD_STRING},
      [F_QUANTITY] = {.name = "quantity", .kind = JSON_FIELD_I64},
  };
  const uint8_t TERMINAL = IDEMHOST_CONSUMER_TYPES_HANDLER_ERROR_TERMINAL;
  const uint8_t RETRYABLE = IDEMHOST_CONSUMER_TYPES_HANDLER_ERROR_RETRYABLE;
  char buf[1024], reason[256];
  text_t t = text_on(buf, sizeof buf);
  bool ok = false;
  if (!json_fields_parse(msg->payload.ptr, msg->payload.len, f, F_COUNT, reason, sizeof reason)) {
    ok = fail(err, TERMINAL, text_add(text_add(&t, "malformed OrderPlaced payload: "), reason));
    goto out;
  }
  const char *order_id = f[F_ORDER_ID].str;
  int64_t quantity = f[F_QUANTITY].i64;
  if (quantity <= 0) {
    ok = fail(err, TERMINAL, text_add(text_add(&t, "quantity must be positive for "), order_id));
    goto out;
  }
  idemhost_consumer_database_sql_value_t params[2] = {
      {.tag = IDEMHOST_CONSUMER_TYPES_SQL_VALUE_INT, .val.int_ = quantity},
      {.tag = IDEMHOST_CONSUMER_TYPES_SQL_VALUE_TEXT,
       .val.text = {(uint8_t *)f[F_SKU].str, f[F_SKU].str_len}},
  };
  idemhost_consumer_database_list_sql_value_t list = {params, 2};
  handler_string_t sql;
  idemhost_consumer_types_db_error_t db_err;
  handler_string_set(&sql, RESERVE);
  uint64_t changed = 0;
  // A SQL error already poisoned the host's transaction; the host classifies it
  // (serialization failures are retried whole), so we only pass its text along.
  if (!idemhost_consumer_database_method_transaction_execute(tx, &sql, &list, &changed, &db_err)) {
    // "SQLSTATE: message", as PostgreSQL said it.
    if (db_err.sqlstate.is_some) {
      text_addn(&t, (const char *)db_err.sqlstate.val.ptr, db_err.sqlstate.val.len);
      text_add(&t, ": ");
    }
    text_addn(&t, (const char *)db_err.message.ptr, db_err.message.len);
    idemhost_consumer_types_db_error_free(&db_err);
    ok = fail(err, RETRYABLE, &t);
    goto out;
  }
  if (changed != 1) {
    text_add(&t, "Unknown SKU or insufficient inventory for ");
    ok = fail(err, TERMINAL, text_add(&t, order_id));
    goto out;
  }
  text_add(text_add_i64(text_add(&t, "reserved "), quantity), " for ");
  log_line("debug", text_add(&t, order_id));
  ok = true;
out:
  json_fields_free(f, F_COUNT);
  return ok;
}

bool exports_idemhost_consumer_handling_handle(exports_idemhost_consumer_handling_borrow_transaction_t tx,
                                               exports_idemhost_consumer_handling_message_t *msg,
                                               handler_error_t *err) {
  bool ok = reserve(tx, msg, err);
  exports_idemhost_consumer_handling_message_free(msg);
  idemhost_consumer_database_transaction_drop_borrow(tx);
  return ok;
}
