/* A preloaded library for scripts/repro-builds/measure.sh (a measurement, not part of idemhost):
 * getrandom returns the same fixed stream at every call, the wall clock is fixed, the monotonic
 * clock a per-thread counter that advances 1 us per read (for calls through libc; raw system
 * calls go to tracer.c). Both are choices for a measurement, not for a build tool: every caller
 * gets the same random bytes (a stream carried on across calls would depend on which thread calls
 * first), and a wait with a deadline on this monotonic clock, or a timer, may never end, so a
 * step that hangs would hang for ever. */
#define _GNU_SOURCE
#pragma GCC diagnostic ignored "-Wnonnull-compare"
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/syscall.h>
#include <stdarg.h>
#include <dlfcn.h>
static __thread uint64_t clock_calls = 0;
ssize_t getrandom(void *buf, size_t len, unsigned flags) { (void)flags; uint64_t s = 0x9E3779B97F4A7C15ull; unsigned char *p = buf; for (size_t i = 0; i < len; i += 8) { uint64_t z = (s += 0x9E3779B97F4A7C15ull); z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; z ^= z >> 31; memcpy(p + i, &z, len - i < 8 ? len - i : 8); } return (ssize_t)len; }
int getentropy(void *buf, size_t len) { getrandom(buf, len, 0); return 0; }
int clock_gettime(clockid_t id, struct timespec *ts) { uint64_t ns = 978307200ull * 1000000000ull + (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE ? 0 : (clock_calls++) * 1000ull); ts->tv_sec = ns / 1000000000ull; ts->tv_nsec = ns % 1000000000ull; return 0; }
int gettimeofday(struct timeval *tv, void *tz) { (void)tz; if (tv) { tv->tv_sec = 978307200; tv->tv_usec = 0; } return 0; }
time_t time(time_t *t) { if (t) *t = 978307200; return 978307200; }
long syscall(long number, ...) {
  static long (*real)(long, ...) = 0;
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  va_list ap; va_start(ap, number); long a[6]; for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long); va_end(ap);
  if (number == SYS_getrandom) return getrandom((void *)a[0], (size_t)a[1], (unsigned)a[2]);
  return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
