// A strict JSON reader (RFC 8259) for C plugins: it checks the whole payload and extracts the
// named top-level fields of an object, with serde_json's rules — UTF-8 only, integers exact in
// the i64 range (no fraction or exponent), duplicate named fields refused, unknown fields
// ignored, nesting limited to 128 levels.
#ifndef IDEMHOST_JSON_FIELDS_H
#define IDEMHOST_JSON_FIELDS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { JSON_FIELD_STRING, JSON_FIELD_I64 } json_field_kind;

typedef struct {
  const char *name;       // in: the field's name
  json_field_kind kind;   // in: the JSON type it must have
  bool seen;              // out
  char *str;              // out (JSON_FIELD_STRING): NUL-terminated, malloc'd; free with json_fields_free
  size_t str_len;         // out
  int64_t i64;            // out (JSON_FIELD_I64)
} json_field;

// Returns true when `buf` is one JSON object holding every field with its kind; otherwise
// false with a reason in `err`.
bool json_fields_parse(const uint8_t *buf, size_t len, json_field *fields, size_t n, char *err,
                       size_t err_len);

void json_fields_free(json_field *fields, size_t n);

#endif
