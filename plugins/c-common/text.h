// A bounded text builder for C plugins. snprintf would link wasi-libc's stdio, whose FILE
// machinery imports WASI preview 1 (fd_write, fd_seek, fd_close) that a plugin must not need;
// this needs nothing. Text past the capacity is cut, never overrun.
#ifndef IDEMHOST_TEXT_H
#define IDEMHOST_TEXT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  char *buf;
  size_t cap;  // including the terminating NUL
  size_t len;
} text_t;

static inline text_t text_on(char *buf, size_t cap) {
  text_t t = {buf, cap, 0};
  if (cap) buf[0] = 0;
  return t;
}

static inline text_t *text_addn(text_t *t, const char *s, size_t n) {
  if (t->cap == 0) return t;
  size_t room = t->cap - 1 - t->len;
  if (n > room) n = room;
  memcpy(t->buf + t->len, s, n);
  t->len += n;
  t->buf[t->len] = 0;
  return t;
}

static inline text_t *text_add(text_t *t, const char *s) { return text_addn(t, s, strlen(s)); }

static inline text_t *text_add_i64(text_t *t, int64_t v) {
  char digits[21];
  size_t i = sizeof digits;
  uint64_t mag = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
  do {
    digits[--i] = (char)('0' + mag % 10);
    mag /= 10;
  } while (mag);
  if (v < 0) digits[--i] = '-';
  return text_addn(t, digits + i, sizeof digits - i);
}

#endif
