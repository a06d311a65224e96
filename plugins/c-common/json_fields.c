// See json_fields.h.
#include "json_fields.h"

#include <stdlib.h>
#include <string.h>

#include "text.h"

#define MAX_DEPTH 128

typedef struct {
  const uint8_t *p;
  const uint8_t *end;
  const uint8_t *start;
  char *err;
  size_t err_len;
} reader;

// A syntax error: `what` and where.
static bool fail(reader *r, const char *what) {
  text_t t = text_on(r->err, r->err_len);
  text_add(text_add(&t, what), " at offset");
  text_add_i64(text_add(&t, " "), (int64_t)(r->p - r->start));
  return false;
}

// A type or value error about field `name`: "<a><b> for `name`".
static bool field_error(char *err, size_t err_len, const char *a, const char *b,
                        const char *name) {
  text_t t = text_on(err, err_len);
  text_add(text_add(text_add(text_add(text_add(&t, a), b), " for `"), name), "`");
  return false;
}

static void ws(reader *r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

// Growable output buffer for decoded strings; `out` may be NULL to only validate.
typedef struct {
  char *buf;
  size_t len, cap;
  bool oom;
} sbuf;

static void put(sbuf *s, const uint8_t *bytes, size_t n) {
  if (!s || s->oom) return;
  if (s->len + n + 1 > s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 32;
    while (cap < s->len + n + 1) cap *= 2;
    char *grown = realloc(s->buf, cap);
    if (!grown) {
      s->oom = true;
      return;
    }
    s->buf = grown;
    s->cap = cap;
  }
  memcpy(s->buf + s->len, bytes, n);
  s->len += n;
  s->buf[s->len] = 0;
}

static void put_code_point(sbuf *s, uint32_t c) {
  uint8_t b[4];
  size_t n;
  if (c < 0x80) {
    b[0] = (uint8_t)c;
    n = 1;
  } else if (c < 0x800) {
    b[0] = 0xC0 | (c >> 6);
    b[1] = 0x80 | (c & 0x3F);
    n = 2;
  } else if (c < 0x10000) {
    b[0] = 0xE0 | (c >> 12);
    b[1] = 0x80 | ((c >> 6) & 0x3F);
    b[2] = 0x80 | (c & 0x3F);
    n = 3;
  } else {
    b[0] = 0xF0 | (c >> 18);
    b[1] = 0x80 | ((c >> 12) & 0x3F);
    b[2] = 0x80 | ((c >> 6) & 0x3F);
    b[3] = 0x80 | (c & 0x3F);
    n = 4;
  }
  put(s, b, n);
}

// Length of the valid UTF-8 sequence at p (1..4), or 0 when it is not one.
static size_t utf8_len(const uint8_t *p, const uint8_t *end) {
  uint8_t c = p[0];
  size_t n;
  uint32_t cp;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1F;
  else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0F;
  else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07;
  else return 0;
  if ((size_t)(end - p) < n) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000)) return 0;
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
  return n;
}

static bool hex4(reader *r, uint32_t *out) {
  if (r->end - r->p < 4) return fail(r, "invalid escape");
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    uint8_t c = *r->p++;
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else return fail(r, "invalid escape");
  }
  *out = v;
  return true;
}

static bool string(reader *r, sbuf *out) {
  r->p++;  // opening quote
  for (;;) {
    if (r->p >= r->end) return fail(r, "EOF while parsing a string");
    uint8_t c = *r->p;
    if (c == '"') {
      r->p++;
      put(out, (const uint8_t *)"", 0);
      return true;
    }
    if (c < 0x20) return fail(r, "control character in string");
    if (c != '\\') {
      size_t n = utf8_len(r->p, r->end);
      if (n == 0) return fail(r, "invalid UTF-8 in string");
      put(out, r->p, n);
      r->p += n;
      continue;
    }
    r->p++;
    if (r->p >= r->end) return fail(r, "EOF while parsing a string");
    uint8_t e = *r->p++;
    const char *simple = strchr("\"\\/bfnrt", e);
    if (e && simple) {
      static const char decoded[] = "\"\\/\b\f\n\r\t";
      put(out, (const uint8_t *)&decoded[simple - "\"\\/bfnrt"], 1);
    } else if (e == 'u') {
      uint32_t cp;
      if (!hex4(r, &cp)) return false;
      if (cp >= 0xD800 && cp < 0xDC00) {
        uint32_t low;
        if (r->end - r->p < 2 || r->p[0] != '\\' || r->p[1] != 'u')
          return fail(r, "lone leading surrogate");
        r->p += 2;
        if (!hex4(r, &low)) return false;
        if (low < 0xDC00 || low >= 0xE000) return fail(r, "lone leading surrogate");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
      } else if (cp >= 0xDC00 && cp < 0xE000) {
        return fail(r, "lone trailing surrogate");
      }
      put_code_point(out, cp);
    } else {
      return fail(r, "invalid escape");
    }
  }
}

typedef enum { NUM_INT, NUM_BIG_INT, NUM_FLOAT } num_kind;

static bool number(reader *r, num_kind *kind, int64_t *value) {
  const uint8_t *s = r->p;
  bool neg = false;
  if (r->p < r->end && *r->p == '-') neg = true, r->p++;
  if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "invalid number");
  // Accumulate the magnitude as unsigned; i64 holds [-2^63, 2^63-1].
  uint64_t mag = 0;
  bool overflow = false;
  if (*r->p == '0') {
    r->p++;
  } else {
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9') {
      uint64_t d = *r->p++ - '0';
      if (mag > (UINT64_MAX - d) / 10) overflow = true;
      else mag = mag * 10 + d;
    }
  }
  bool frac = false;
  if (r->p < r->end && *r->p == '.') {
    r->p++;
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "invalid number");
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    frac = true;
  }
  if (r->p < r->end && (*r->p == 'e' || *r->p == 'E')) {
    r->p++;
    if (r->p < r->end && (*r->p == '+' || *r->p == '-')) r->p++;
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "invalid number");
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    frac = true;
  }
  (void)s;
  if (frac) {
    *kind = NUM_FLOAT;
  } else if (overflow || (neg && mag > (uint64_t)INT64_MAX + 1) || (!neg && mag > INT64_MAX)) {
    *kind = NUM_BIG_INT;
  } else {
    *kind = NUM_INT;
    *value = neg ? (int64_t)(0 - mag) : (int64_t)mag;
  }
  return true;
}

static bool literal(reader *r, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) return fail(r, "expected value");
  r->p += n;
  return true;
}

static bool value(reader *r, int depth);

static bool container(reader *r, int depth) {
  uint8_t open = *r->p;
  uint8_t close = open == '{' ? '}' : ']';
  if (depth >= MAX_DEPTH) return fail(r, "recursion limit exceeded");
  r->p++;
  ws(r);
  if (r->p < r->end && *r->p == close) {
    r->p++;
    return true;
  }
  for (;;) {
    if (open == '{') {
      ws(r);
      if (r->p >= r->end || *r->p != '"') return fail(r, "key must be a string");
      if (!string(r, NULL)) return false;
      ws(r);
      if (r->p >= r->end || *r->p++ != ':') return fail(r, "expected `:`");
    }
    if (!value(r, depth + 1)) return false;
    ws(r);
    if (r->p >= r->end) return fail(r, "EOF while parsing a container");
    uint8_t sep = *r->p++;
    if (sep == close) return true;
    if (sep != ',') return fail(r, close == '}' ? "expected `,` or `}`" : "expected `,` or `]`");
  }
}

static bool value(reader *r, int depth) {
  ws(r);
  if (r->p >= r->end) return fail(r, "EOF while parsing a value");
  switch (*r->p) {
    case '{':
    case '[':
      return container(r, depth);
    case '"':
      return string(r, NULL);
    case 't':
      return literal(r, "true");
    case 'f':
      return literal(r, "false");
    case 'n':
      return literal(r, "null");
    default: {
      num_kind kind;
      int64_t v;
      return number(r, &kind, &v);
    }
  }
}

static const char *describe(uint8_t c) {
  switch (c) {
    case '{': return "map";
    case '[': return "sequence";
    case '"': return "string";
    case 't':
    case 'f': return "boolean";
    case 'n': return "null";
    default: return "number";
  }
}

static bool field(reader *r, json_field *f) {
  ws(r);
  if (r->p >= r->end) return fail(r, "EOF while parsing a value");
  uint8_t c = *r->p;
  if (f->kind == JSON_FIELD_STRING) {
    if (c != '"') {
      char what[64];
      text_t t = text_on(what, sizeof what);
      text_add(text_add(&t, "invalid type: "), describe(c));
      return field_error(r->err, r->err_len, what, ", expected a string", f->name);
    }
    sbuf out = {0};
    if (!string(r, &out) || out.oom) {
      free(out.buf);
      return out.oom ? fail(r, "out of memory") : false;
    }
    f->str = out.buf;
    f->str_len = out.len;
    return true;
  }
  if (c != '-' && (c < '0' || c > '9')) {
    char what[64];
    text_t t = text_on(what, sizeof what);
    text_add(text_add(&t, "invalid type: "), describe(c));
    return field_error(r->err, r->err_len, what, ", expected i64", f->name);
  }
  num_kind kind;
  if (!number(r, &kind, &f->i64)) return false;
  if (kind == NUM_FLOAT) {
    return field_error(r->err, r->err_len, "invalid type: floating point", ", expected i64",
                       f->name);
  }
  if (kind == NUM_BIG_INT) {
    return field_error(r->err, r->err_len, "invalid value: integer", " out of range for i64",
                       f->name);
  }
  return true;
}

bool json_fields_parse(const uint8_t *buf, size_t len, json_field *fields, size_t n, char *err,
                       size_t err_len) {
  reader r = {buf, buf + len, buf, err, err_len};
  for (size_t i = 0; i < n; i++) fields[i].seen = false, fields[i].str = NULL;
  ws(&r);
  if (r.p >= r.end) return fail(&r, "EOF while parsing a value");
  if (*r.p != '{') {
    text_t t = text_on(err, err_len);
    text_add(text_add(text_add(&t, "invalid type: "), describe(*r.p)), ", expected an object");
    return false;
  }
  r.p++;
  ws(&r);
  bool empty = r.p < r.end && *r.p == '}';
  if (empty) r.p++;
  while (!empty) {
    ws(&r);
    if (r.p >= r.end || *r.p != '"') return fail(&r, "key must be a string");
    sbuf key = {0};
    if (!string(&r, &key) || key.oom) {
      free(key.buf);
      return key.oom ? fail(&r, "out of memory") : false;
    }
    ws(&r);
    if (r.p >= r.end || *r.p++ != ':') {
      free(key.buf);
      return fail(&r, "expected `:`");
    }
    json_field *f = NULL;
    for (size_t i = 0; i < n && key.buf; i++) {
      if (strlen(fields[i].name) == key.len && memcmp(fields[i].name, key.buf, key.len) == 0)
        f = &fields[i];
    }
    free(key.buf);
    if (f && f->seen) {
      return field_error(err, err_len, "duplicate field", "", f->name);
    }
    if (f) {
      if (!field(&r, f)) return false;
      f->seen = true;
    } else if (!value(&r, 1)) {
      return false;
    }
    ws(&r);
    if (r.p >= r.end) return fail(&r, "EOF while parsing an object");
    uint8_t sep = *r.p++;
    if (sep == '}') break;
    if (sep != ',') return fail(&r, "expected `,` or `}`");
  }
  ws(&r);
  if (r.p < r.end) return fail(&r, "trailing characters");
  for (size_t i = 0; i < n; i++) {
    if (!fields[i].seen) {
      return field_error(err, err_len, "missing field", "", fields[i].name);
    }
  }
  return true;
}

void json_fields_free(json_field *fields, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(fields[i].str);
    fields[i].str = NULL;
  }
}
